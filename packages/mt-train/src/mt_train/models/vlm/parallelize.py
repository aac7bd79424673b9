"""The vision-language family's parallelize plan: both towers' blocks are the units of full
recompute, compile and FSDP2 sharding; the logits GEMM is ``language.output``; with
``model.fp8_vision=false`` the encoder's linears (and the projector's) stay high precision.
Under sequence parallel the encoder and projector stay plain TP (``sequence_parallel_skip``):
their tokens are the images', replicated over the TP group, not the decoder's sequence."""

from __future__ import annotations

import mt_parallel
from mt_train.models.vlm.config import VLMConfig
from mt_train.models.vlm.vision import VisionBlock

BLOCK_TYPES = (mt_parallel.DecoderBlock, VisionBlock)
OUTPUT_HEAD = "language.output"
IMAGE_TOWER = ("vision.", "projector.")


def vlm_plan(cfg: VLMConfig) -> mt_parallel.ParallelizePlan:
    skip = () if cfg.fp8_vision else IMAGE_TOWER
    return mt_parallel.ParallelizePlan(
        BLOCK_TYPES, output_head=OUTPUT_HEAD, fp8_skip=skip, sequence_parallel_skip=IMAGE_TOWER
    )

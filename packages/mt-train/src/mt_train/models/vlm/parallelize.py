"""The vision-language family's parallelize plan: both towers' blocks are the units of full
recompute, compile and FSDP2 sharding; the logits GEMM is ``language.output``; with
``model.fp8_vision=false`` the encoder's linears (and the projector's) stay high precision.
Under sequence parallel the encoder and projector stay plain TP (``sequence_parallel_skip``):
their tokens are the images', replicated over the TP group, not the decoder's sequence.

Under pipeline parallelism the first chunk holds the encoder, the projector and the image
placement with the decoder's embedding and computes its hidden states with
:func:`~mt_train.models.vlm.model.embed_with_images` from the tokens and the micro-batch's
``images`` (which only it reads); the last chunk holds the decoder's norm and head and the
loss module (its cp group)."""

from __future__ import annotations

import mt_parallel
from mt_train.models.vlm.config import VLMConfig
from mt_train.models.vlm.model import embed_with_images
from mt_train.models.vlm.vision import VisionBlock

BLOCK_TYPES = (mt_parallel.DecoderBlock, VisionBlock)
OUTPUT_HEAD = "language.output"
IMAGE_TOWER = ("vision.", "projector.")
PIPELINE = mt_parallel.PipelineLayout(
    embedding="language.embed",
    blocks="language.layers",
    final=("language.norm", "language.output"),
    first_extra=("vision", "projector", "image_placement"),
    embed=embed_with_images,
    first_inputs=("images",),
    last_extra=("caption_loss",),
    block_positions="sample_positions",
)


def vlm_plan(cfg: VLMConfig) -> mt_parallel.ParallelizePlan:
    skip = () if cfg.fp8_vision else IMAGE_TOWER
    return mt_parallel.ParallelizePlan(
        BLOCK_TYPES,
        output_head=OUTPUT_HEAD,
        fp8_skip=skip,
        sequence_parallel_skip=IMAGE_TOWER,
        pipeline=PIPELINE,
    )

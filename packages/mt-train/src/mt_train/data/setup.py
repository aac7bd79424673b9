"""The run's training data: one prepared folder (or the bundled corpus) or a blend of folders.

:func:`open_training_data` checks what it opens before the model is built (each folder against
its ``meta.json`` and ``trainer.seq_len``, the model's vocabulary when the config sets one, one
tokenizer across a blend) and returns the data module with this data-parallel rank's sampler.
With ``data.path`` unset rank 0 prepares the bundled corpus into ``<run folder>/data`` first
and every rank waits for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mt_train import ranks
from mt_train.config.schema import TrainConfig
from mt_train.data.blend import BlendedDataModule, check_same_tokenizer
from mt_train.data.checks import check_image_text, check_prepared, check_vocab
from mt_train.data.dataset import DataModule, ResumableSampler
from mt_train.data.image_text import ImageTextDataset
from mt_train.data.prepare import prepare_bundled
from mt_train.errors import DataError


def open_training_data(
    cfg: TrainConfig, output_dir: Path, rank: int, device: Any, dp_rank: int, dp_size: int
) -> tuple[DataModule | BlendedDataModule, Any]:
    """The data module and this rank's sampler for ``cfg.data`` (module docstring)."""
    tr = cfg.trainer
    if cfg.data.blend_sources:
        if cfg.data.pack_samples:
            raise DataError(
                "data.pack_samples=true packs one image-text folder (data.path or data=digits); "
                "a data.blend mixes text folders, whose windows are packed already"
            )
        sources = [(Path(f).expanduser(), w) for f, w in cfg.data.blend_sources]
        folders = [f for f, _ in sources]
        metas = [check_prepared(f, tr.seq_len) for f in folders]
        check_same_tokenizer(folders, metas)
        if cfg.model.vocab_size is not None:
            check_vocab(metas[0], cfg.model.vocab_size, folders[0])
        blend = BlendedDataModule(sources, tr.seq_len, train_stride=cfg.data.train_stride)
        sampler = blend.sampler(
            tr.seed, tr.global_batch_size, tr.micro_batch_size, dp_rank, dp_size,
            cfg.data.independent_draws,
        )  # fmt: skip
        return blend, sampler
    data_dir = Path(cfg.data.path).expanduser() if cfg.data.path else output_dir / "data"
    if cfg.data.path is None:
        image_tokens = getattr(cfg.model, "image_tokens", None)
        ranks.on_rank0(
            lambda: prepare_bundled(data_dir, cfg.data.val_every, cfg.data.bundled, image_tokens),
            rank,
            device,
        )
    ranks.barrier()
    try:
        data_meta = check_prepared(data_dir, tr.seq_len)
    except DataError as err:
        if cfg.data.path is not None:
            raise
        raise DataError(
            f"{err} (the bundled corpus: delete {data_dir} to prepare it again)"
        ) from None
    if cfg.model.vocab_size is not None:
        check_vocab(data_meta, cfg.model.vocab_size, data_dir)
    check_image_text(data_meta, cfg.model, data_dir)
    data = DataModule(
        data_dir,
        tr.seq_len,
        cfg.data.train_stride,
        pack_samples=cfg.data.pack_samples,
        pad_images=tr.cuda_graph,
        pack_order=cfg.data.pack_order,
        pack_seed=tr.seed,
    )
    sampler = ResumableSampler(
        len(data.train), tr.seed, tr.global_batch_size, tr.micro_batch_size, dp_rank, dp_size,
        independent=cfg.data.independent_draws,
    )  # fmt: skip
    return data, sampler


def data_label(data: DataModule | BlendedDataModule) -> str:
    """The data folder, or the blend as ``weight·folder`` terms; for image-text data also how
    rows are filled and the train rows' padding share."""
    if isinstance(data, BlendedDataModule):
        terms = zip(data.weights, data.folders, strict=True)
        return "blend " + " + ".join(f"{w:.3g}·{f}" for w, f in terms)
    if isinstance(data.train, ImageTextDataset):
        train = data.train
        rows = f"{train.pack_order} packs" if train.pack_order else "one sample a row"
        return f"{data.folder}, {rows}, {train.padding_fraction:.1%} padding"
    return str(data.folder)

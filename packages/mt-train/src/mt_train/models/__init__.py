"""Model families (one folder each, registered as plugins) and the build path every family
shares: build the plain model, then :func:`mt_parallel.parallelize` it with the family's plan."""

from mt_train.models.build import build_model, fp8_options, parallelize, resolve_vocab
from mt_train.models.family import HFAdapter, ModelFamily
from mt_train.models.registry import family_of, get_family, model_families, model_sizes

__all__ = [
    "HFAdapter",
    "ModelFamily",
    "build_model",
    "family_of",
    "fp8_options",
    "get_family",
    "model_families",
    "model_sizes",
    "parallelize",
    "resolve_vocab",
]

"""Training-data attribution on per-sample features: a feature store on disk and influence scores.

    with FeatureStore.open("feats", n=len(train), k=512, seed=0, kind="kron") as store:
        for idx, x, y in loader:                    # idx: the samples' positions in the dataset
            store.write(idx, features_of(x, y))     # [B, k] projected per-sample gradients
    values, where = top_k(test_features, FeatureStore.open("feats", readonly=True), k=10)

pergrad's core never imports this package; it needs numpy (``pip install 'pergrad[attribution]'``, which
also brings tqdm for ``progress=True``).
"""

from .errors import AttributionError, MissingFeaturesError, ScoreArgumentError, StoreIndexError, StoreSpecError
from .scores import (
    FeatureSource,
    Gram,
    Identity,
    KroneckerFactored,
    KroneckerPair,
    Preconditioner,
    ekfac,
    feature_columns,
    gram,
    iter_scores,
    scores,
    self_influence,
    top_k,
)
from .store import FeatureStore, StoreSpec

__all__ = [
    "AttributionError",
    "FeatureSource",
    "FeatureStore",
    "Gram",
    "Identity",
    "KroneckerFactored",
    "KroneckerPair",
    "MissingFeaturesError",
    "Preconditioner",
    "ScoreArgumentError",
    "StoreIndexError",
    "StoreSpec",
    "StoreSpecError",
    "ekfac",
    "feature_columns",
    "gram",
    "iter_scores",
    "scores",
    "self_influence",
    "top_k",
]

"""Training-data attribution on per-sample features: a feature store on disk and influence scores.

    store = FeatureStore.open("feats", n=len(train), k=512, checkpoints=names, kind="kron",
                              output="margin", out_to_loss=True)
    for name in names:                              # each checkpoint: its own projection seed
        psm = PerSampleModule(load(name), loss_reduction="sum")
        psm.register_projection(psm.module, **store.projection(name))
        for idx, x, y in loader:                    # idx: the samples' positions in the dataset
            f, q = margin(psm(x), y)                # TRAK's model output and out-to-loss term
            f.sum().backward()
            store.write_from(psm, idx, name, out_to_loss=q)
    values, where = top_k(test_features, store, 10, preconditioner="trak")

The query's features may differentiate any measurement of its own (a test loss, a class's log-probability):
``scores`` takes them as they come. Other routes: ``"gram"`` (the Gram of loss gradients), ``"identity"``
(TracIn), ``ekfac(store, blocks)`` (LoGra / EK-FAC; ``sampled_labels`` for the true Fisher); per-token stores
and ``token_scores``; ``subsets`` / ``retrain`` / ``lds`` to measure any of them on your task
(docs/guides/attribution.md has the LDS of each, measured beside traker).

pergrad's core never imports this package; it needs numpy (``pip install 'pergrad[attribution]'``, which
also brings tqdm for ``progress=True``).
"""

from .errors import AttributionError, MissingFeaturesError, ScoreArgumentError, StoreIndexError, StoreSpecError
from .evaluate import lds, loo_correlation, ranks, retrain, spearman, subsets
from .outputs import lm_margin, margin, sampled_labels
from .scores import (
    TRAK,
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
    token_scores,
    top_k,
    trak,
)
from .store import FeatureStore, StoreSpec, checkpoint_seeds

__all__ = [
    "TRAK",
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
    "checkpoint_seeds",
    "ekfac",
    "feature_columns",
    "gram",
    "iter_scores",
    "lds",
    "lm_margin",
    "loo_correlation",
    "margin",
    "ranks",
    "retrain",
    "sampled_labels",
    "scores",
    "self_influence",
    "spearman",
    "subsets",
    "token_scores",
    "top_k",
    "trak",
]

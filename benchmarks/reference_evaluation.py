"""The classic LFW verification protocol as straightforward loops: the reference for tests.

``calculate_roc`` / ``calculate_val`` / ``calculate_accuracy`` / ``calculate_val_far`` follow
the classic FaceNet code line by line (a Python loop over every threshold of every fold), with
two changes: its ``interp1d(far_train, thresholds, kind="slinear")``, which raises on current
SciPy when training FAR values repeat, is replaced by the stated rule (:func:`threshold_for_far`),
and distances can be given directly (as ``embeddings1``, ``embeddings2`` None).
``distance_metric="angular"`` is davidsandberg/facenet's ``arccos(cos_sim) / pi``, unclipped
as there (NaN never "same"). Deliberately slow and simple: ``facenet.evaluation.protocol``
must give the same numbers.
"""

from __future__ import annotations

import numpy as np
from sklearn.model_selection import KFold


def distance(embeddings1, embeddings2, distance_metric="squared"):
    """(N,) distance between matching rows of two (N, D) arrays."""
    if distance_metric in ("cosine", "angular"):
        dot = np.sum(embeddings1 * embeddings2, axis=1)
        norm = np.linalg.norm(embeddings1, axis=1) * np.linalg.norm(embeddings2, axis=1)
        if distance_metric == "angular":
            return np.arccos(dot / norm) / np.pi
        return 1.0 - dot / norm
    dist = np.sum(np.square(embeddings1 - embeddings2), axis=1)
    return dist if distance_metric == "squared" else np.sqrt(dist)


def calculate_accuracy(threshold, dist, actual_issame):
    """(tpr, fpr, accuracy) at one threshold; rates are 0 where the denominator is 0."""
    predict_issame = np.less(dist, threshold)
    tp = np.sum(np.logical_and(predict_issame, actual_issame))
    fp = np.sum(np.logical_and(predict_issame, np.logical_not(actual_issame)))
    tn = np.sum(np.logical_and(np.logical_not(predict_issame), np.logical_not(actual_issame)))
    fn = np.sum(np.logical_and(np.logical_not(predict_issame), actual_issame))
    tpr = 0 if (tp + fn == 0) else float(tp) / float(tp + fn)
    fpr = 0 if (fp + tn == 0) else float(fp) / float(fp + tn)
    acc = float(tp + tn) / dist.size
    return tpr, fpr, acc


def calculate_val_far(threshold, dist, actual_issame):
    """(val, far) at one threshold."""
    predict_issame = np.less(dist, threshold)
    true_accept = np.sum(np.logical_and(predict_issame, actual_issame))
    false_accept = np.sum(np.logical_and(predict_issame, np.logical_not(actual_issame)))
    n_same = np.sum(actual_issame)
    n_diff = np.sum(np.logical_not(actual_issame))
    val = float(true_accept) / float(n_same)
    far = float(false_accept) / float(n_diff)
    return val, far


def _fold_distances(embeddings1, embeddings2, train_set, distance_metric, subtract_mean):
    if embeddings2 is None:  # embeddings1: the distances, given
        return embeddings1
    if subtract_mean:
        mean = np.mean(np.concatenate([embeddings1[train_set], embeddings2[train_set]]), axis=0)
    else:
        mean = 0.0
    return distance(embeddings1 - mean, embeddings2 - mean, distance_metric)


def calculate_roc(
    thresholds,
    embeddings1,
    embeddings2,
    actual_issame,
    nrof_folds=10,
    distance_metric="squared",
    subtract_mean=False,
):
    """Classic ROC and accuracy: returns (tpr, fpr, accuracy, best_thresholds)."""
    nrof_pairs = len(actual_issame)
    nrof_thresholds = len(thresholds)
    k_fold = KFold(n_splits=nrof_folds, shuffle=False)
    tprs = np.zeros((nrof_folds, nrof_thresholds))
    fprs = np.zeros((nrof_folds, nrof_thresholds))
    accuracy = np.zeros(nrof_folds)
    best_thresholds = np.zeros(nrof_folds)
    indices = np.arange(nrof_pairs)
    for fold_idx, (train_set, test_set) in enumerate(k_fold.split(indices)):
        d = _fold_distances(embeddings1, embeddings2, train_set, distance_metric, subtract_mean)
        acc_train = np.zeros(nrof_thresholds)
        for threshold_idx, threshold in enumerate(thresholds):
            _, _, acc_train[threshold_idx] = calculate_accuracy(
                threshold, d[train_set], actual_issame[train_set]
            )
        best_threshold_index = np.argmax(acc_train)
        for threshold_idx, threshold in enumerate(thresholds):
            tprs[fold_idx, threshold_idx], fprs[fold_idx, threshold_idx], _ = calculate_accuracy(
                threshold, d[test_set], actual_issame[test_set]
            )
        _, _, accuracy[fold_idx] = calculate_accuracy(
            thresholds[best_threshold_index], d[test_set], actual_issame[test_set]
        )
        best_thresholds[fold_idx] = thresholds[best_threshold_index]
    tpr = np.mean(tprs, 0)
    fpr = np.mean(fprs, 0)
    return tpr, fpr, accuracy, best_thresholds


def threshold_for_far(far_train, thresholds, far_target):
    """The stated rule that replaces the classic ``interp1d``: interpolate linearly between the
    two neighbouring grid thresholds where FAR first reaches the target (the first threshold if
    it is already there; 0.0 if it never reaches it)."""
    for j in range(len(thresholds)):
        if far_train[j] >= far_target:
            if j == 0:
                return thresholds[0]
            return np.interp(far_target, far_train[j - 1 : j + 1], thresholds[j - 1 : j + 1])
    return 0.0


def calculate_val(
    thresholds,
    embeddings1,
    embeddings2,
    actual_issame,
    far_target,
    nrof_folds=10,
    distance_metric="squared",
    subtract_mean=False,
):
    """Classic VAL at FAR: returns (val_mean, val_std, far_mean, val, far, fold_thresholds)."""
    nrof_pairs = len(actual_issame)
    nrof_thresholds = len(thresholds)
    k_fold = KFold(n_splits=nrof_folds, shuffle=False)
    val = np.zeros(nrof_folds)
    far = np.zeros(nrof_folds)
    fold_thresholds = np.zeros(nrof_folds)
    indices = np.arange(nrof_pairs)
    for fold_idx, (train_set, test_set) in enumerate(k_fold.split(indices)):
        d = _fold_distances(embeddings1, embeddings2, train_set, distance_metric, subtract_mean)
        far_train = np.zeros(nrof_thresholds)
        for threshold_idx, threshold in enumerate(thresholds):
            _, far_train[threshold_idx] = calculate_val_far(
                threshold, d[train_set], actual_issame[train_set]
            )
        threshold = threshold_for_far(far_train, thresholds, far_target)
        fold_thresholds[fold_idx] = threshold
        val[fold_idx], far[fold_idx] = calculate_val_far(
            threshold, d[test_set], actual_issame[test_set]
        )
    return np.mean(val), np.std(val), np.mean(far), val, far, fold_thresholds

"""The publishers' evaluation scripts as loops, re-written from reading them: the references
``facenet.evaluation.presets`` is held to (davidsandberg/facenet's ``lfw.evaluate``,
Xiaoccer/MobileFaceNet_Pytorch's ``lfw_eval.py``), on top of the classic loops of
``benchmarks.reference_evaluation``."""

import numpy as np
from sklearn.model_selection import KFold

from benchmarks.reference_evaluation import calculate_roc, calculate_val, calculate_val_far


def training_far_curves(thresholds, dist, actual_issame, nrof_folds=10):
    """(F, T) training-fold FAR at every threshold, by the loop (to find repeating FAR inputs)."""
    k_fold = KFold(n_splits=nrof_folds, shuffle=False)
    curves = np.zeros((nrof_folds, len(thresholds)))
    for fold_idx, (train_set, _) in enumerate(k_fold.split(np.arange(len(actual_issame)))):
        for threshold_idx, threshold in enumerate(thresholds):
            _, curves[fold_idx, threshold_idx] = calculate_val_far(
                threshold, dist[train_set], actual_issame[train_set]
            )
    return curves


def publisher_evaluate(
    embeddings, actual_issame, nrof_folds=10, distance_metric="squared", subtract_mean=False
):
    """davidsandberg/facenet's ``lfw.evaluate``: (tpr, fpr, accuracy, val, val_std, far).

    Args:
        embeddings: (2N, D) with pair i at rows 2i and 2i + 1 (flip-concatenated by the caller).
        actual_issame: (N,) bool.
        nrof_folds: contiguous folds.
        distance_metric: "squared" (its 0) or "angular" (its 1).
        subtract_mean: subtract the training folds' mean embedding.
    """
    embeddings1, embeddings2 = embeddings[0::2], embeddings[1::2]
    issame = np.asarray(actual_issame)
    options = dict(
        nrof_folds=nrof_folds, distance_metric=distance_metric, subtract_mean=subtract_mean
    )
    tpr, fpr, accuracy, _ = calculate_roc(
        np.arange(0, 4, 0.01), embeddings1, embeddings2, issame, **options
    )
    val, val_std, far, _, _, _ = calculate_val(
        np.arange(0, 4, 0.001), embeddings1, embeddings2, issame, 1e-3, **options
    )
    return tpr, fpr, accuracy, val, val_std, far


# --------------------------------------------------------------------------- MobileFaceNet's
# Xiaoccer/MobileFaceNet_Pytorch, lfw_eval.py (getAccuracy, getThreshold, evaluation_10_fold),
# re-written from reading it, loop for loop. Its conventions differ from the classic code's:
# scores are cosine SIMILARITIES of the mean-subtracted, re-normalised features (the
# flip-concatenated raw network outputs); a pair is "same" when score > threshold and
# "different" when score < threshold (a score equal to the threshold is wrong either way); the
# grid is arange(-10000, 10001) / 10000; the threshold is the MEAN of every grid threshold
# that reaches the best training accuracy (the classic code takes the first); folds are
# i // 600 of the pairs.txt line, contiguous.


def mobilefacenet_get_accuracy(scores, flags, threshold):
    """``getAccuracy``: flags are 1 (same) or -1 (different)."""
    p = np.sum(scores[flags == 1] > threshold)
    n = np.sum(scores[flags == -1] < threshold)
    return 1.0 * (p + n) / len(scores)


def mobilefacenet_get_threshold(scores, flags, thr_num=10000, rule="mean"):
    """``getThreshold``: the mean of the grid thresholds of best accuracy (``rule="first"``:
    the highest of them instead, the first best as the classic code scans distances upward,
    to compare with ``facenet.evaluation.protocol``)."""
    accuracys = np.zeros((2 * thr_num + 1, 1))
    thresholds = np.arange(-thr_num, thr_num + 1) * 1.0 / thr_num
    for i in range(2 * thr_num + 1):
        accuracys[i] = mobilefacenet_get_accuracy(scores, flags, thresholds[i])
    max_index = np.squeeze(accuracys == np.max(accuracys))
    if rule == "first":
        return np.max(thresholds[max_index])
    return np.mean(thresholds[max_index])


def mobilefacenet_fold_scores(feature_ls, feature_rs, fold, i):
    """Cosine similarity of every pair after subtracting the mean of the folds other than i
    and re-normalising (the body of ``evaluation_10_fold``'s loop)."""
    val_fold = fold != i
    mu = np.mean(np.concatenate((feature_ls[val_fold, :], feature_rs[val_fold, :]), 0), 0)
    mu = np.expand_dims(mu, 0)
    feature_ls = feature_ls - mu
    feature_rs = feature_rs - mu
    feature_ls = feature_ls / np.expand_dims(np.sqrt(np.sum(np.power(feature_ls, 2), 1)), 1)
    feature_rs = feature_rs / np.expand_dims(np.sqrt(np.sum(np.power(feature_rs, 2), 1)), 1)
    return np.sum(np.multiply(feature_ls, feature_rs), 1)


def mobilefacenet_evaluate(feature_ls, feature_rs, fold, flags, thr_num=10000, rule="mean"):
    """``evaluation_10_fold``: (ACCs (10,), thresholds (10,)), the test accuracy of each fold
    at the similarity threshold chosen on the other nine.

    Args:
        feature_ls: (N, 2D) features of the first images: [net(x), net(flipped x)], raw.
        feature_rs: (N, 2D) features of the second images.
        fold: (N,) fold of each pair (``i // 600`` for LFW's pairs.txt).
        flags: (N,) 1 for same, -1 for different.
        thr_num: the grid's half size (thresholds ``arange(-thr_num, thr_num + 1) / thr_num``).
        rule: "mean" (the publisher's) or "first" (see :func:`mobilefacenet_get_threshold`).
    """
    accs, thresholds = np.zeros(10), np.zeros(10)
    for i in range(10):
        scores = mobilefacenet_fold_scores(feature_ls, feature_rs, fold, i)
        val_fold, test_fold = fold != i, fold == i
        thresholds[i] = mobilefacenet_get_threshold(
            scores[val_fold], flags[val_fold], thr_num, rule
        )
        accs[i] = mobilefacenet_get_accuracy(scores[test_fold], flags[test_fold], thresholds[i])
    return accs, thresholds

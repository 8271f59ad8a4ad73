"""Recompute ``facenet-evaluate --ijb``'s figures from its features.npz alone (or with another
pair file), independently of the package: plain NumPy and scikit-learn, written from reading
insightface's recognition/arcface_torch/eval_ijbc.py (deepinsight/insightface, commit
7fadd420c2351d0ffa8cac403421c1a3ed733365): image2template_feature, verification and the
TPR@FPR table, in float64 (insightface pools in float32).

    python tools/ijb_from_features.py OUT/features.npz [ROOT/meta/<name>_template_pair_label.txt]

prints the TAR at each FAR and the AUC as JSON.
"""

import json
import sys

import numpy as np
from sklearn.metrics import auc, roc_curve

X_LABELS = [10**-6, 10**-5, 10**-4, 10**-3, 10**-2, 10**-1]


def image2template_feature(img_feats, templates, medias):
    """Media means summed per template, then unit length: one loop per template as insightface."""
    unique_templates = np.unique(templates)
    template_feats = np.zeros((len(unique_templates), img_feats.shape[1]))
    for count_template, uqt in enumerate(unique_templates):
        face_feats = img_feats[templates == uqt]
        face_medias = medias[templates == uqt]
        media_feats = [face_feats[face_medias == u].mean(axis=0) for u in np.unique(face_medias)]
        template_feats[count_template] = np.sum(media_feats, axis=0)
    norms = np.sqrt(np.sum(template_feats**2, axis=1, keepdims=True))
    return template_feats / np.where(norms == 0, 1, norms), unique_templates


def tpr_fpr_row(label, score):
    """({FAR: TAR}, AUC): the TPR at the ROC point nearest each FPR, as insightface's table."""
    fpr, tpr, _ = roc_curve(label, score)
    roc_auc = auc(fpr, tpr)
    fpr, tpr = np.flipud(fpr), np.flipud(tpr)  # select largest tpr at same fpr
    row = {}
    for x in X_LABELS:
        _, min_index = min(zip(abs(fpr - x), range(len(fpr))))
        row[f"{x:g}"] = float(tpr[min_index])
    return row, float(roc_auc)


def recompute(features_file, pair_file=None):
    """{"tar_at_far": {FAR: TAR}, "auc": AUC, "scores": (P,) cosines} from the written
    features."""
    data = np.load(features_file, allow_pickle=False)
    img_feats = data["image_features"].astype(np.float64)
    if not data["norm_score"]:
        img_feats = img_feats / np.sqrt(np.sum(img_feats**2, -1, keepdims=True))
    if data["detector_score"]:
        img_feats = img_feats * data["image_scores"][:, np.newaxis]
    feats, unique_templates = image2template_feature(
        img_feats, data["image_templates"], data["image_media"]
    )
    if pair_file is None:
        p1, p2, label = data["pairs"][:, 0], data["pairs"][:, 1], data["labels"]
    else:
        p1, p2, label = np.loadtxt(pair_file, dtype=np.int64, ndmin=2).T
    template2id = {t: i for i, t in enumerate(unique_templates.tolist())}
    ids1 = np.array([template2id[t] for t in p1.tolist()], dtype=np.int64)
    ids2 = np.array([template2id[t] for t in p2.tolist()], dtype=np.int64)
    score = np.sum(feats[ids1] * feats[ids2], -1)
    row, roc_auc = tpr_fpr_row(label, score)
    return {"tar_at_far": row, "auc": roc_auc, "scores": score}


if __name__ == "__main__":
    figures = recompute(*sys.argv[1:3])
    print(json.dumps({key: figures[key] for key in ("tar_at_far", "auc")}, indent=1))

"""Property tests (hypothesis): miners, the verification protocol and the pairs parser on
random input. Each either gives a valid result or raises its documented, clear error.

Examples are derandomized, so a run is reproducible, and kept few, so the file stays fast.
"""

import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from facenet.data.pairs import MissingImagesError, PairsFormatError, read_pairs
from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.protocol import (
    default_thresholds,
    evaluate_embeddings,
    evaluate_verification,
)
from facenet.metric.batch_hard_miner import BatchHardMiner
from facenet.metric.distances import get_distance
from facenet.metric.miners import SemiHardNegativeMiner
from facenet.metric.triplet_margin_miner import TripletMarginMiner

FEW = settings(max_examples=40, deadline=None, derandomize=True)
MINER_EXAMPLES = settings(max_examples=100, deadline=None, derandomize=True)
DISTANCES = ("squared", "euclidean", "cosine")

# --------------------------------------------------------------------------- miners

# Grid values make ties (equal distances) common; floats cover the rest.
coordinates = st.one_of(
    st.floats(-3, 3, width=32, allow_subnormal=False), st.sampled_from([0.0, 0.5, 1.0, -1.0])
)


@st.composite
def labelled_batches(draw):
    """(embeddings (B, D) float32, labels (B,) int64) with B in 0..12.

    Mostly every label of ``range(n_labels)`` in a shuffled order (so most batches hold
    triplets); sometimes arbitrary labels (one identity, singletons, empty batches).
    """
    dim = draw(st.integers(1, 4))
    if draw(st.integers(0, 3)):  # at least one positive pair and one negative
        n_labels = draw(st.integers(2, 4))
        size = draw(st.integers(n_labels + 1, 12))
        labels = np.array(draw(st.permutations(range(size))), dtype=np.int64) % n_labels
    else:
        n_labels, size = draw(st.integers(1, 4)), draw(st.integers(0, 12))
        labels = draw(arrays(np.int64, size, elements=st.integers(0, n_labels - 1)))
    embeddings = draw(arrays(np.float32, (size, dim), elements=coordinates))
    return torch.from_numpy(embeddings), torch.from_numpy(labels)


def assert_valid_triplets(triplets, labels):
    """Indices in range, int64, one length; a/p share a label, n has another, a != p."""
    a, p, n = triplets
    size = labels.shape[0]
    assert a.dtype == p.dtype == n.dtype == torch.int64
    assert a.shape == p.shape == n.shape and a.ndim == 1
    for index in (a, p, n):
        assert bool(((index >= 0) & (index < size)).all())
    assert bool((labels[a] == labels[p]).all())
    assert bool((labels[a] != labels[n]).all())
    assert bool((a != p).all())


def positive_pairs(labels):
    """[(a, p)] of every ordered pair of distinct images with one label."""
    size = labels.shape[0]
    return [(a, p) for a in range(size) for p in range(size) if a != p and labels[a] == labels[p]]


def negatives_of(labels, a):
    return [n for n in range(labels.shape[0]) if labels[n] != labels[a]]


MARGIN_TESTS = {
    "all": lambda dap, dan, m: dan <= dap + m,
    "hard": lambda dap, dan, m: (dan <= dap) & (dan <= dap + m),
    "semihard": lambda dap, dan, m: (dan > dap) & (dan <= dap + m),
    "easy": lambda dap, dan, m: dan > dap + m,
}


@MINER_EXAMPLES
@given(
    labelled_batches(),
    st.sampled_from(sorted(MARGIN_TESTS)),
    st.sampled_from(DISTANCES),
    st.floats(0.0, 1.0),
)
def test_triplet_margin_miner_returns_exactly_the_brute_force_set(batch, kind, distance, margin):
    embeddings, labels = batch
    miner = TripletMarginMiner(margin, kind, distance)
    triplets = miner(embeddings, labels)
    assert_valid_triplets(triplets, labels)
    dist = get_distance(distance)(embeddings)  # (B, B), the values the miner compares
    passes = MARGIN_TESTS[kind]
    expected = {
        (a, p, n)
        for a, p in positive_pairs(labels)
        for n in negatives_of(labels, a)
        if bool(passes(dist[a, p], dist[a, n], torch.tensor(margin, dtype=dist.dtype)))
    }
    got = list(zip(*(t.tolist() for t in triplets)))
    assert len(got) == len(set(got)) and set(got) == expected
    event("triplets" if got else "no triplet")


@MINER_EXAMPLES
@given(labelled_batches(), st.sampled_from(DISTANCES))
def test_batch_hard_takes_each_anchors_farthest_positive_and_nearest_negative(batch, distance):
    embeddings, labels = batch
    triplets = BatchHardMiner(distance)(embeddings, labels)
    assert_valid_triplets(triplets, labels)
    dist = get_distance(distance)(embeddings)
    eligible = [
        a
        for a in range(labels.shape[0])
        if negatives_of(labels, a) and any(x == a for x, _ in positive_pairs(labels))
    ]
    assert triplets.anchor.tolist() == eligible
    for a, p, n in zip(*(t.tolist() for t in triplets)):
        positives = [q for x, q in positive_pairs(labels) if x == a]
        assert dist[a, p] == dist[a, positives].max()
        assert dist[a, n] == dist[a, negatives_of(labels, a)].min()


@MINER_EXAMPLES
@given(
    labelled_batches(),
    st.sampled_from(DISTANCES),
    st.sampled_from(["hardest", "skip"]),
    st.floats(0.01, 1.0),
    st.integers(0, 6),
)
def test_semihard_miner_draws_from_the_band_or_falls_back_to_the_hardest(
    batch, distance, fallback, margin, max_triplets
):
    embeddings, labels = batch
    generator = torch.Generator().manual_seed(0)
    miner = SemiHardNegativeMiner(margin, distance, fallback, generator, max_triplets=max_triplets)
    triplets = miner(embeddings, labels)
    assert_valid_triplets(triplets, labels)
    dist = get_distance(distance)(embeddings)
    bound = torch.tensor(margin, dtype=dist.dtype)
    eligible = 0
    for a, p in positive_pairs(labels):
        band = [n for n in negatives_of(labels, a) if dist[a, p] < dist[a, n] < dist[a, p] + bound]
        eligible += bool(band) or (fallback == "hardest" and bool(negatives_of(labels, a)))
    assert len(triplets.anchor) == (min(eligible, max_triplets) if max_triplets else eligible)
    event("triplets" if eligible else "no triplet")
    for a, p, n in zip(*(t.tolist() for t in triplets)):
        in_band = dist[a, p] < dist[a, n] < dist[a, p] + bound
        hardest = dist[a, n] == dist[a, negatives_of(labels, a)].min()
        band_empty = not any(
            dist[a, p] < dist[a, m] < dist[a, p] + bound for m in negatives_of(labels, a)
        )
        assert in_band or (fallback == "hardest" and hardest and band_empty)


@MINER_EXAMPLES
@given(labelled_batches(), st.data())
def test_miners_filter_random_candidates_to_a_subset_of_them(batch, data):
    embeddings, labels = batch
    size = labels.shape[0]
    count = data.draw(st.integers(0, 20)) if size else 0
    index = st.integers(0, max(size - 1, 0))
    candidates = tuple(
        torch.tensor(data.draw(st.lists(index, min_size=count, max_size=count)), dtype=torch.long)
        for _ in range(3)
    )
    given_set = set(zip(*(t.tolist() for t in candidates)))
    for miner in (TripletMarginMiner(0.2, "all"), BatchHardMiner(), SemiHardNegativeMiner()):
        kept = miner(embeddings, labels, candidates=candidates)
        assert set(zip(*(t.tolist() for t in kept))) <= given_set


# --------------------------------------------------------------------------- evaluation


@st.composite
def folded_pairs(draw):
    """(distances (N,), issame (N,), fold ids (N,), n_folds): both classes in every fold."""
    n_folds = draw(st.integers(2, 5))
    distances, issame, folds = [], [], []
    for fold in range(n_folds):
        size = draw(st.integers(2, 8))
        same = [True, False] + draw(st.lists(st.booleans(), min_size=size - 2, max_size=size - 2))
        distances += draw(st.lists(st.floats(0, 4), min_size=size, max_size=size))
        issame += same
        folds += [fold] * size
    return np.array(distances), np.array(issame), np.array(folds), n_folds


def assert_metrics_in_range(result):
    for name in ("accuracy_mean", "val", "far", "auc", "eer"):
        assert 0.0 <= getattr(result, name) <= 1.0, name
    assert result.accuracy_std >= 0 and result.val_std >= 0
    for curve in (
        result.accuracy,
        result.tpr,
        result.fpr,
        result.val_per_fold,
        result.far_per_fold,
    ):
        assert np.all((curve >= 0) & (curve <= 1))
    assert np.isclose(result.accuracy_mean, result.accuracy.mean())


@FEW
@given(folded_pairs(), st.sampled_from(DISTANCES), st.floats(1e-3, 1.0))
def test_verification_metrics_are_in_range_and_match_a_brute_force_fold_accuracy(
    case, distance, far_target
):
    dist, issame, folds, n_folds = case
    protocol = VerifySettings(n_folds=n_folds, far_target=far_target, distance=distance)
    result = evaluate_verification(dist, issame, protocol, folds)
    assert_metrics_in_range(result)
    grid = default_thresholds(distance)
    for fold in range(n_folds):
        test, train = folds == fold, folds != fold
        threshold = result.best_thresholds[fold]
        # Accuracy on the test fold at the threshold the training folds chose ...
        correct = (dist[test] < threshold) == issame[test]
        assert result.accuracy[fold] == pytest.approx(correct.mean())
        # ... which is the grid's best on the training folds.
        train_acc = ((dist[train][:, None] < grid) == issame[train][:, None]).mean(0)  # (T,)
        assert train_acc[np.searchsorted(grid, threshold)] == pytest.approx(train_acc.max())


finite_or_not = st.one_of(st.floats(0, 5), st.sampled_from([0.0, 1.0, -1.0, np.nan, np.inf]))


@FEW
@given(st.integers(0, 30), st.one_of(st.integers(2, 3), st.integers(0, 6)), st.data())
def test_verification_on_arbitrary_input_gives_metrics_in_range_or_a_value_error(
    size, n_folds, data
):
    # Mostly matching lengths, finite distances and both classes per fold; sometimes not.
    values = finite_or_not if data.draw(st.integers(0, 3)) == 0 else st.floats(0, 5)
    distances = data.draw(st.lists(values, min_size=size, max_size=size))
    if data.draw(st.booleans()):
        issame = [i % 2 == 0 for i in range(size)]
    else:
        issame = data.draw(st.lists(st.booleans(), min_size=size, max_size=size))
    if data.draw(st.integers(0, 9)) == 0:
        issame = issame[: data.draw(st.integers(0, size))]
    try:
        result = evaluate_verification(
            np.array(distances), np.array(issame), VerifySettings(n_folds=n_folds)
        )
    except ValueError as err:
        assert str(err)  # a message, not a bare error
        event("value error")
        return
    event("evaluated")
    assert_metrics_in_range(result)


@FEW
@given(
    st.integers(4, 24),
    st.integers(1, 5),
    st.sampled_from(DISTANCES),
    st.booleans(),
    st.data(),
)
def test_embedding_evaluation_on_random_embeddings(size, dim, metric, subtract_mean, data):
    emb1 = data.draw(arrays(np.float32, (size, dim), elements=coordinates))
    emb2 = data.draw(arrays(np.float32, (size, dim), elements=coordinates))
    issame = np.arange(size) % 2 == 0  # alternating: both classes in every contiguous fold
    try:
        protocol = VerifySettings(distance=metric, subtract_mean=subtract_mean, n_folds=2)
        result = evaluate_embeddings(emb1, emb2, issame, protocol)
    except ValueError as err:
        # A zero-length embedding has no cosine distance; nothing else may fail.
        assert metric == "cosine" and "zero-length" in str(err)
        return
    assert_metrics_in_range(result)


# --------------------------------------------------------------------------- pairs files

IMAGES = {"anna": 3, "bob": 2}


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lfw")
    for name, count in IMAGES.items():
        (root / name).mkdir()
        for index in range(1, count + 1):
            (root / name / f"{name}_{index:04d}.jpg").write_bytes(b"\xff\xd8\xff\xd9")
    return root


token = st.one_of(
    st.sampled_from(["anna", "bob", "carl", "1", "2", "3", "9", "0", "10", "-1", "1.5", "x"]),
    st.integers(0, 10**6).map(str),
    st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=6),
)
pair_line = st.one_of(
    st.lists(token, min_size=0, max_size=5).map(" ".join),
    st.lists(token, min_size=0, max_size=5).map("\t".join),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20),
)
header = st.one_of(st.sampled_from(["1\t1", "1\t2", "2\t1", "1", "2", "0\t1", "x"]), pair_line)


# Mostly images that exist (anna 1-3, bob 1-2), sometimes one that does not.
name = st.sampled_from(["anna", "bob"] * 4 + ["carl"])
index = st.sampled_from([1, 2] * 4 + [0, 7])
same_line = st.tuples(name, index, index).map(lambda t: f"{t[0]}\t{t[1]}\t{t[2]}")
different_line = st.tuples(name, index, name, index).map(lambda t: "\t".join(map(str, t)))


@st.composite
def well_formed(draw):
    """A header and as many pair lines as it promises; images may or may not exist."""
    n_folds, per_fold = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    lines = []
    for _ in range(n_folds):
        lines += draw(st.lists(same_line, min_size=per_fold, max_size=per_fold))
        lines += draw(st.lists(different_line, min_size=per_fold, max_size=per_fold))
    return f"{n_folds}\t{per_fold}", lines


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    st.one_of(well_formed(), st.tuples(header, st.lists(pair_line, max_size=6))),
    st.sampled_from(["\n", "\r\n"]),
)
@example(("1\t" + "9" * 5000, []), "\n")  # more digits than int() converts
@example(("1\t1", ["anna\t1\t" + "7" * 5000, "anna\t1\tbob\t1"]), "\n")
def test_pairs_parser_gives_pairs_or_an_error_naming_file_and_line(image_root, case, newline):
    first, lines = case
    path = image_root / "pairs.txt"
    text = newline.join([first, *lines]) + newline
    path.write_bytes(text.encode("utf-8"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            pairs = read_pairs(path)
        except PairsFormatError as err:
            n_lines = len(text.splitlines()) + 1
            assert 0 <= err.line_no <= n_lines
            assert re.match(re.escape(str(path)) + r"(:\d+)?: ", str(err)), str(err)
            event("format error")
            return
        except MissingImagesError as err:
            assert str(err).startswith(str(path)) and err.missing
            event("missing images")
            return
    event("parsed")
    assert len(pairs) > 0
    for first_path, second_path in zip(pairs.paths1, pairs.paths2):
        assert (image_root / first_path).is_file() and (image_root / second_path).is_file()
    for line_no, same in zip(pairs.line_numbers, pairs.issame):
        fields = text.splitlines()[line_no - 1].split()
        assert (len(fields) == 3) == bool(same)

"""Erasure-coded RAM copies as pure functions: the rotated layout (replicator/parity/layout.py), the codes
(replicator/parity/codec.py), a whole group encoded and rebuilt in memory as the encoder and decoder do it,
the coordinator's groups and decodability (replicator/coordinator/planning/parity.py), and the setting's parser
(replicator/wire/redundancy.py)."""

import itertools
import random

import numpy as np
import pytest

from replicator.coordinator.planning.parity import _rebuildable, deal, parity_of
from replicator.parity.codec import ReedSolomon, Xor, codec
from replicator.parity.layout import GroupLayout, cluster_ram, stream_bytes, stream_pieces
from replicator.wire.redundancy import REPLICAS, Redundancy, parse

SHAPES = [(3, 1), (4, 1), (8, 1), (8, 2), (5, 3)]


def layout_of(n: int, k: int, sizes=None) -> GroupLayout:
    return GroupLayout(tuple(range(100, 100 + n)), k, tuple(sizes or [1000 + 37 * p for p in range(n)]))


# --- layout ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_every_stripe_has_k_holders_and_n_minus_k_contributors_covering_the_group(n, k):
    layout = layout_of(n, k)
    assert (layout.size, layout.data) == (n, n - k)
    for stripe in range(n):
        holders, contributors = layout.holders(stripe), layout.contributors(stripe)
        assert len(holders) == k and len(set(holders)) == k
        assert len(contributors) == n - k and len(set(contributors)) == n - k
        assert not set(holders) & set(contributors)
        assert set(holders) | set(contributors) == set(range(n))
        assert holders[0] == stripe  # SCR's rotation: stripe s starts its parity at position s


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_every_position_holds_k_shards_and_contributes_n_minus_k_segments(n, k):
    layout = layout_of(n, k)
    held_count = dict.fromkeys(range(n), 0)
    for position in range(n):
        held = layout.held_by(position)
        assert len(held) == k
        assert sorted(index for _, index in held) == list(range(k))
        for stripe, index in held:
            assert layout.holders(stripe)[index] == position
            held_count[position] += 1
            with pytest.raises(ValueError):
                layout.segment_of(position, stripe)
        stripes = layout.stripes_of(position)
        assert len(stripes) == n - k
        assert not set(stripes) & {s for s, _ in held}
        assert [layout.segment_of(position, s) for s in stripes] == list(range(n - k))
        for stripe in stripes:
            assert position in layout.contributors(stripe)
    assert set(held_count.values()) == {k}
    # every (stripe, shard index) is held by exactly one position
    all_held = [h for p in range(n) for h in layout.held_by(p)]
    assert sorted(all_held) == sorted((s, j) for s in range(n) for j in range(k))
    # every (stripe, fragment) is one position's one segment
    all_segments = [(s, layout.contributors(s).index(p)) for p in range(n) for s in layout.stripes_of(p)]
    assert sorted(all_segments) == sorted((s, i) for s in range(n) for i in range(n - k))


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("longest", [1, 7, 8, 1000, 4097, 123457, 64 << 20])
def test_segment_bytes_is_a_word_multiple_covering_the_longest_stream(n, k, longest):
    sizes = [longest] + [longest // (p + 2) for p in range(n - 1)]
    random.Random(longest).shuffle(sizes)
    layout = layout_of(n, k, sizes)
    segment = layout.segment_bytes
    assert segment % 8 == 0
    assert segment * (n - k) >= longest
    assert segment < -(-longest // (n - k)) + 8  # no more than the rounding up to a word


@pytest.mark.parametrize(("n", "k"), [(3, 0), (3, 3), (3, 4), (1, 1), (2, 2)])
def test_a_group_refuses_parity_outside_1_to_n_minus_1(n, k):
    with pytest.raises(ValueError):
        layout_of(n, k)


def test_a_layout_wants_one_stream_length_per_member():
    with pytest.raises(ValueError):
        GroupLayout((1, 2, 3), 1, (10, 20))


@pytest.mark.parametrize(("n", "k", "ram"), [(2, 1, 2.0), (4, 1, 4 / 3), (8, 1, 8 / 7), (8, 2, 8 / 6), (5, 3, 2.5)])
def test_cluster_ram(n, k, ram):
    assert cluster_ram(n, k) == pytest.approx(ram)


# --- stream_pieces --------------------------------------------------------------------------------------------

FILES = {"b.bin": (5, "x"), "a.bin": (3, "x"), "c/empty": (0, "x"), "c/z.bin": (4, "x"), "d": (6, "x")}
# sorted: a.bin [0, 3), b.bin [3, 8), c/empty [8, 8), c/z.bin [8, 12), d [12, 18)


def test_stream_bytes_sums_the_files():
    assert stream_bytes(FILES) == 18
    assert stream_bytes({}) == 0


@pytest.mark.parametrize(
    ("start", "length", "pieces"),
    [
        (0, 18, [("a.bin", 0, 3), ("b.bin", 0, 5), ("c/z.bin", 0, 4), ("d", 0, 6)]),
        (0, 3, [("a.bin", 0, 3)]),
        (2, 2, [("a.bin", 2, 1), ("b.bin", 0, 1)]),
        (3, 5, [("b.bin", 0, 5)]),
        (7, 2, [("b.bin", 4, 1), ("c/z.bin", 0, 1)]),
        (8, 4, [("c/z.bin", 0, 4)]),
        (1, 15, [("a.bin", 1, 2), ("b.bin", 0, 5), ("c/z.bin", 0, 4), ("d", 0, 4)]),
        (15, 100, [("d", 3, 3)]),
        (10, 1000, [("c/z.bin", 2, 2), ("d", 0, 6)]),
        (18, 8, []),
        (40, 8, []),
        (5, 0, []),
    ],
)
def test_stream_pieces_map_ranges_onto_files_in_sorted_path_order(start, length, pieces):
    assert list(stream_pieces(FILES, start, length)) == pieces


def test_stream_pieces_rebuild_every_range_of_random_files():
    rng = random.Random(7)
    sizes = [0, 1, 13, 0, 4096, 7, 0, 255, 1000]
    files = {f"f{rng.random():.8f}/{i}": (size, "x") for i, size in enumerate(sizes)}
    contents = {path: rng.randbytes(size) for path, (size, _) in files.items()}
    stream = b"".join(contents[p] for p in sorted(files))
    assert len(stream) == stream_bytes(files)
    for _ in range(300):
        start = rng.randrange(0, len(stream) + 50)
        length = rng.randrange(0, len(stream) + 50)
        pieces = list(stream_pieces(files, start, length))
        assert all(n > 0 for _, _, n in pieces)  # no empty piece, not even for a 0-byte file
        assert b"".join(contents[p][at : at + n] for p, at, n in pieces) == stream[start : start + length]


# --- codec ----------------------------------------------------------------------------------------------------


def random_segments(count: int, length: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length, dtype=np.uint8).tobytes() for _ in range(count)]


def test_codec_picks_xor_for_one_parity_shard_and_reed_solomon_for_more():
    assert isinstance(codec(3, 1), Xor)
    rs = codec(6, 2)
    assert isinstance(rs, ReedSolomon) and (rs.data, rs.parity) == (6, 2)


def test_xor_parity_is_the_xor_of_the_segments():
    segments = random_segments(3, 64, 1)
    (parity,) = Xor(3).encode(segments)
    expected = bytes(a ^ b ^ c for a, b, c in zip(*segments))
    assert parity == expected


@pytest.mark.parametrize(("data", "parity"), [(1, 1), (3, 1), (7, 1), (6, 2), (5, 3), (2, 2)])
@pytest.mark.parametrize("length", [8, 4096, 65544])
def test_encode_then_rebuild_every_loss_of_up_to_k_data_segments(data, parity, length):
    code = codec(data, parity)
    segments = random_segments(data, length, seed=data * 100 + parity + length)
    shards = code.encode(segments)
    assert len(shards) == parity and all(len(s) == length for s in shards)
    everything = dict(enumerate(segments + shards))
    for lost_count in range(1, parity + 1):
        for lost in itertools.combinations(range(data), lost_count):
            # every way of choosing which of the survivors (data and parity) to hand over
            survivors = [i for i in everything if i not in lost]
            for chosen in itertools.combinations(survivors, data):
                rebuilt = code.rebuild({i: everything[i] for i in chosen}, list(lost))
                assert rebuilt == {i: segments[i] for i in lost}, (lost, chosen)


@pytest.mark.parametrize(("data", "parity"), [(1, 1), (1, 2), (2, 2), (2, 3), (3, 3)])
def test_rebuild_from_parity_shards_alone_where_there_are_enough(data, parity):
    code = codec(data, parity)
    segments = random_segments(data, 1024, seed=data + 10 * parity)
    shards = code.encode(segments)
    for chosen in itertools.combinations(range(parity), data):
        only_parity = {data + j: shards[j] for j in chosen}
        wanted = list(range(min(data, parity)))
        assert code.rebuild(only_parity, wanted) == {i: segments[i] for i in wanted}


def test_rebuild_with_nothing_lost_returns_nothing():
    for code in (codec(3, 1), codec(6, 2)):
        segments = random_segments(code.data, 64, 3)
        assert code.rebuild(dict(enumerate(segments)), []) == {}


@pytest.mark.parametrize(("data", "parity"), [(3, 1), (7, 1), (6, 2), (5, 3)])
def test_too_few_shards_are_refused(data, parity):
    code = codec(data, parity)
    segments = random_segments(data, 256, 5)
    everything = dict(enumerate(segments + code.encode(segments)))
    survivors = {i: s for i, s in everything.items() if i != 0}
    short = dict(list(survivors.items())[: data - 1])
    with pytest.raises(ValueError, match="cannot rebuild"):
        code.rebuild(short, [0])
    with pytest.raises(ValueError, match="cannot rebuild"):
        code.rebuild({}, [0])


@pytest.mark.parametrize(("data", "parity"), [(3, 1), (6, 2)])
def test_unequal_shards_and_rebuilding_a_parity_shard_are_refused(data, parity):
    code = codec(data, parity)
    segments = random_segments(data, 256, 6)
    everything = dict(enumerate(segments + code.encode(segments)))
    unequal = {i: s for i, s in everything.items() if i != 0}
    unequal[1] = unequal[1][:128]
    with pytest.raises(ValueError, match="unequal"):
        code.rebuild(unequal, [0])
    with pytest.raises(ValueError, match="only data segments"):
        code.rebuild({i: s for i, s in everything.items() if i != data}, [data])


# --- a whole group, encoded and rebuilt in memory -------------------------------------------------------------


def padded(stream: bytes, layout: GroupLayout) -> bytes:
    return stream + bytes(layout.segment_bytes * layout.data - len(stream))


def encode_group(layout: GroupLayout, streams: list[bytes]) -> dict[int, dict[tuple[int, int], bytes]]:
    """Each position's parity shards {(stripe, index): bytes}, as replicator/parity/encoder.py builds them: the
    contributors' segments at ``segment_of(p, stripe) * segment_bytes``, zeros past a stream's end."""
    code, length = codec(layout.data, layout.parity), layout.segment_bytes
    full = [padded(s, layout) for s in streams]
    held: dict[int, dict[tuple[int, int], bytes]] = {}
    for position in range(layout.size):
        for stripe, index in layout.held_by(position):
            segments = []
            for p in layout.contributors(stripe):
                base = layout.segment_of(p, stripe) * length
                segments.append(full[p][base : base + length])
            held.setdefault(position, {})[(stripe, index)] = code.encode(segments)[index]
    return held


def rebuild_member(
    layout: GroupLayout,
    position: int,
    lost: set[int],
    streams: list[bytes],
    held: dict[int, dict[tuple[int, int], bytes]],
) -> bytes:
    """``position``'s stream from the survivors, as replicator/parity/decoder.py plans it: for each stripe it
    contributes to, the live members' segments first, then the live parity shards, the first n - k of them."""
    code, length = codec(layout.data, layout.parity), layout.segment_bytes
    full = [padded(s, layout) for s in streams]
    shards = {key: shard for p, owned in held.items() if p not in lost for key, shard in owned.items()}
    out = bytearray(length * layout.data)
    for stripe in layout.stripes_of(position):
        contributors = layout.contributors(stripe)
        data = [i for i, p in enumerate(contributors) if p not in lost]
        parity = [layout.data + j for j in range(layout.parity) if (stripe, j) in shards]
        chosen = (data + parity)[: layout.data]
        assert len(chosen) == layout.data, f"stripe {stripe} cannot be rebuilt with {sorted(lost)} lost"
        got = {}
        for i in chosen:
            if i < layout.data:
                base = layout.segment_of(contributors[i], stripe) * length
                got[i] = full[contributors[i]][base : base + length]
            else:
                got[i] = shards[(stripe, i - layout.data)]
        wanted = contributors.index(position)
        piece = code.rebuild(got, [wanted])[wanted]
        segment = layout.segment_of(position, stripe)
        out[segment * length : (segment + 1) * length] = piece
    rebuilt = bytes(out)
    assert rebuilt[layout.stream_bytes[position] :] == bytes(len(rebuilt) - layout.stream_bytes[position])
    return rebuilt[: layout.stream_bytes[position]]


def group_streams(n: int, seed: int, base: int = 40_000) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [rng.randrange(base // 2, base * 2) for _ in range(n)]
    sizes[rng.randrange(n)] = 0  # one member saved nothing
    sizes[rng.randrange(n)] = base * 2 + 3  # and the longest is not a word multiple
    return [rng.randbytes(size) for size in sizes]


@pytest.mark.parametrize(("n", "k"), [(2, 1), (3, 1), (4, 1), (8, 1), (4, 2), (8, 2), (5, 3)])
def test_a_group_rebuilds_any_k_lost_members_from_survivors_and_shards(n, k):
    streams = group_streams(n, seed=n * 10 + k)
    layout = GroupLayout(tuple(range(n)), k, tuple(len(s) for s in streams))
    held = encode_group(layout, streams)
    assert sum(len(owned) for owned in held.values()) == n * k
    assert {len(shard) for owned in held.values() for shard in owned.values()} == {layout.segment_bytes}
    for count in range(1, k + 1):
        for lost in itertools.combinations(range(n), count):
            for position in lost:
                assert rebuild_member(layout, position, set(lost), streams, held) == streams[position], lost


def test_a_group_does_not_survive_more_than_k_losses():
    streams = group_streams(4, seed=3)
    layout = GroupLayout(tuple(range(4)), 1, tuple(len(s) for s in streams))
    held = encode_group(layout, streams)
    with pytest.raises(AssertionError, match="cannot be rebuilt"):
        rebuild_member(layout, 0, {0, 1}, streams, held)


def test_a_corrupted_parity_shard_rebuilds_wrong_bytes():
    """The arithmetic alone cannot tell: the decoder's CRC-32C checks are what catch it."""
    streams = group_streams(4, seed=4)
    layout = GroupLayout(tuple(range(4)), 1, tuple(len(s) for s in streams))
    held = encode_group(layout, streams)
    position = max(range(4), key=lambda p: len(streams[p]))
    stripe = layout.stripes_of(position)[0]
    holder = layout.holders(stripe)[0]
    shard = bytearray(held[holder][(stripe, 0)])
    shard[0] ^= 0xFF
    held[holder][(stripe, 0)] = bytes(shard)
    assert rebuild_member(layout, position, {position}, streams, held) != streams[position]


# --- the coordinator's groups ---------------------------------------------------------------------------------


def topology(ranks: int, block_of_rank):
    node_of_rank = {r: f"node-{r}" for r in range(ranks)}
    block_of = {f"node-{r}": f"block-{block_of_rank(r)}" for r in range(ranks)}
    return node_of_rank, block_of


@pytest.mark.parametrize(
    "block_of_rank",
    [lambda r: r // 2, lambda r: r % 4, lambda r: (r * 3) % 8 // 2],
    ids=["adjacent", "strided", "mixed"],
)
def test_eight_ranks_on_four_blocks_of_two_make_two_groups_across_blocks(block_of_rank):
    node_of_rank, block_of = topology(8, block_of_rank)
    groups = deal(list(range(8)), 4, block_of, node_of_rank)
    assert len(groups) == 2 and all(len(g) == 4 for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(8))
    for group in groups:
        blocks = [block_of[node_of_rank[r]] for r in group]
        assert len(set(blocks)) == 4, (group, blocks)
        assert list(group) == sorted(group)


def test_six_ranks_in_groups_of_four_make_two_groups_of_three():
    node_of_rank, block_of = topology(6, lambda r: r // 2)
    groups = deal(list(range(6)), 4, block_of, node_of_rank)
    assert sorted(len(g) for g in groups) == [3, 3]
    assert sorted(r for g in groups for r in g) == list(range(6))
    for group in groups:
        assert len({block_of[node_of_rank[r]] for r in group}) == 3


def test_a_lone_rank_forms_no_group():
    node_of_rank, block_of = topology(1, lambda r: 0)
    assert deal([0], 4, block_of, node_of_rank) == []
    assert deal([], 4, {}, {}) == []


def test_groups_are_stable_for_the_same_input():
    node_of_rank, block_of = topology(12, lambda r: (r * 5) % 6)
    first = deal(list(range(12)), 4, block_of, node_of_rank)
    ranks = list(range(12))
    for seed in range(5):
        random.Random(seed).shuffle(ranks)
        assert deal(list(ranks), 4, dict(block_of), dict(node_of_rank)) == first
    assert len(first) == 3


@pytest.mark.parametrize(("ranks", "size"), [(2, 4), (5, 4), (7, 3), (9, 8), (16, 8), (10, 3), (64, 64)])
def test_every_rank_is_dealt_into_a_group_of_at_most_size(ranks, size):
    node_of_rank, block_of = topology(ranks, lambda r: r % 3)
    groups = deal(list(range(ranks)), size, block_of, node_of_rank)
    assert sorted(r for g in groups for r in g) == list(range(ranks))
    assert all(2 <= len(g) <= size for g in groups)
    assert max(len(g) for g in groups) - min(len(g) for g in groups) <= 1


@pytest.mark.parametrize("ranks", [3, 5])
def test_an_odd_number_of_ranks_in_groups_of_two_leaves_no_rank_out(ranks):
    node_of_rank, block_of = topology(ranks, lambda r: r)
    groups = deal(list(range(ranks)), 2, block_of, node_of_rank)
    assert sorted(r for g in groups for r in g) == list(range(ranks))


def test_parity_of_a_group_smaller_than_the_setting_asks():
    assert parity_of(parse("rs:8:2"), (1, 2, 3, 4, 5, 6, 7, 8)) == 2
    assert parity_of(parse("rs:8:3"), (1, 2, 3)) == 2
    assert parity_of(parse("rs:8:2"), (1, 2)) == 1
    assert parity_of(parse("xor:4"), (1, 2, 3)) == 1


# --- decodability ---------------------------------------------------------------------------------------------


def all_shards(n: int, k: int) -> set[tuple[int, int]]:
    return {(s, j) for s in range(n) for j in range(k)}


def decodable(n: int, k: int, lost: set[int], shards: set[tuple[int, int]] | None = None) -> dict[int, bool]:
    """For each lost position: whether the survivors (and the shards of live holders) rebuild it."""
    group = tuple(range(10, 10 + n))
    if shards is None:
        layout = layout_of(n, k)
        shards = {h for p in range(n) if p not in lost for h in layout.held_by(p)}
    live = set(range(n)) - lost
    return {p: _rebuildable(group, k, p, live, shards) for p in sorted(lost)}


def test_xor_of_four_rebuilds_one_lost_member_not_two():
    for p in range(4):
        assert decodable(4, 1, {p}) == {p: True}
    for lost in itertools.combinations(range(4), 2):
        assert decodable(4, 1, set(lost)) == dict.fromkeys(lost, False)


def test_rs_eight_two_rebuilds_two_lost_members_not_three():
    for lost in itertools.combinations(range(8), 2):
        assert decodable(8, 2, set(lost)) == dict.fromkeys(lost, True)
    # every position is in every stripe (holder or contributor): three lost leave each stripe 5 of the 6 it needs
    for lost in itertools.combinations(range(8), 3):
        assert decodable(8, 2, set(lost)) == dict.fromkeys(lost, False), lost


def test_a_missing_parity_shard_costs_one_loss_of_tolerance():
    n, k = 4, 1
    shards = all_shards(n, k) - {(0, 0)}  # stripe 0's only shard is gone (its holder is live but lost it)
    # positions contributing to stripe 0 (1, 2, 3) are no longer rebuildable once lost; 0 still is
    assert {p: _rebuildable(tuple(range(n)), k, p, set(range(n)) - {p}, shards) for p in range(n)} == {
        0: True,
        1: False,
        2: False,
        3: False,
    }
    # RS(8,2) without shard j of stripe s: any one member lost still rebuilds; of two lost p and q, p no longer
    # rebuilds exactly when it contributes to s and q is another of s's contributors or holds s's other shard
    n, k = 8, 2
    layout = layout_of(n, k)
    group = tuple(range(n))
    for stripe, j in [(s, j) for s in range(n) for j in range(k)]:
        shards = all_shards(n, k) - {(stripe, j)}
        other_holder = layout.holders(stripe)[1 - j]
        for p in range(n):
            assert _rebuildable(group, k, p, set(group) - {p}, shards - set(layout.held_by(p))) is True
        broken = 0
        for p, q in itertools.permutations(range(n), 2):
            expected = stripe in layout.stripes_of(p) and (q in layout.contributors(stripe) or q == other_holder)
            live_shards = shards - set(layout.held_by(p)) - set(layout.held_by(q))
            assert _rebuildable(group, k, p, set(group) - {p, q}, live_shards) is not expected, (stripe, j, p, q)
            broken += expected
        assert broken == 6 * 5 + 6  # p among s's 6 contributors, q another of them (5) or the other holder (1)


def test_rebuildable_agrees_with_the_in_memory_rebuild():
    """_rebuildable's verdict is exactly whether the decoder's plan finds n - k shards for every stripe."""
    for n, k in [(4, 1), (5, 2), (8, 2)]:
        streams = group_streams(n, seed=n + k, base=800)
        layout = GroupLayout(tuple(range(n)), k, tuple(len(s) for s in streams))
        held = encode_group(layout, streams)
        for count in range(1, k + 2):
            for lost in itertools.combinations(range(n), count):
                shards = {key for p, owned in held.items() if p not in lost for key in owned}
                for p in lost:
                    verdict = _rebuildable(layout.members, k, p, set(range(n)) - set(lost), shards)
                    if verdict:
                        assert rebuild_member(layout, p, set(lost), streams, held) == streams[p]
                    else:
                        with pytest.raises(AssertionError, match="cannot be rebuilt"):
                            rebuild_member(layout, p, set(lost), streams, held)


# --- the setting ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed", "shown"),
    [
        ("replicas", REPLICAS, "replicas"),
        (" replicas\n", REPLICAS, "replicas"),
        ("xor:2", Redundancy(2, 1), "xor:2"),
        ("xor:4", Redundancy(4, 1), "xor:4"),
        ("xor:64", Redundancy(64, 1), "xor:64"),
        ("rs:8:2", Redundancy(8, 2), "rs:8:2"),
        ("rs:2:1", Redundancy(2, 1), "xor:2"),  # one parity shard is XOR, whatever it was called
        ("rs:5:3", Redundancy(5, 3), "rs:5:3"),
        ("rs:64:63", Redundancy(64, 63), "rs:64:63"),
    ],
)
def test_parse_accepts(text, parsed, shown):
    got = parse(text)
    assert got == parsed
    assert str(got) == shown
    assert got.encoded is (parsed.parity > 0)
    assert parse(str(got)) == got


@pytest.mark.parametrize(
    "text",
    [
        "xor:1",
        "xor:0",
        "xor:65",
        "xor:999",
        "rs:4:4",
        "rs:4:5",
        "rs:4:0",
        "rs:1:1",
        "rs:65:2",
        "mirror",
        "",
        "xor",
        "xor:",
        "rs:8",
        "xor:4:1",
        "XOR:4",
        "xor:-4",
        "replicas:2",
    ],
)
def test_parse_refuses(text):
    with pytest.raises(ValueError, match="redundancy"):
        parse(text)


def test_replicas_are_not_encoded():
    assert not REPLICAS.encoded
    assert (REPLICAS.group, REPLICAS.parity) == (0, 0)


_ORBAX_YAML = """job-name: j
framework: orbax
assume-data-parallelism: 1
node-rank: 0
nodes: 2
peer-ranks: []
backup-interval-minutes: 5
"""


def test_replicator_yaml_may_set_the_jobs_redundancy_and_a_bad_one_names_the_field():
    from replicator.local_tier.frameworks.base import InvalidReplicatorConfig
    from replicator.local_tier.frameworks.orbax import Orbax

    assert Orbax().parse_config(_ORBAX_YAML, 0, 2).redundancy is None  # the agents' --redundancy then
    assert Orbax().parse_config(_ORBAX_YAML + "redundancy: rs:4:2\n", 0, 2).redundancy == "rs:4:2"
    with pytest.raises(InvalidReplicatorConfig, match="redundancy"):
        Orbax().parse_config(_ORBAX_YAML + "redundancy: xor:1\n", 0, 2)

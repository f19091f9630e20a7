"""Packed metadata: hand-checked values, the cache-off twin rebuilding the same thing, build counts."""

from __future__ import annotations

import pytest
import torch

from trainer.data.packed_metadata import (
    PackedMetadata,
    UncachedPackedMetadata,
    build_packed_metadata,
)

CPU = torch.device("cpu")


class TestBuildPackedMetadata:
    def test_lengths_3_2_4_give_hand_checked_offsets_and_positions(self) -> None:
        meta = build_packed_metadata([3, 2, 4], "cpu")
        assert isinstance(meta, PackedMetadata)
        assert meta.cu_seqlens.dtype == torch.int32
        assert meta.cu_seqlens.tolist() == [0, 3, 5, 9]
        assert meta.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
        assert meta.position_ids.dtype == torch.int64
        assert meta.segment_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
        assert meta.max_seqlen == 4 and isinstance(meta.max_seqlen, int)
        assert meta.lengths == (3, 2, 4) and meta.total == 9 and meta.num_samples == 3

    def test_dense_mask_is_block_diagonal_causal(self) -> None:
        mask = build_packed_metadata([3, 2, 4], "cpu").dense_mask(None, CPU)[0, 0]
        expected = torch.zeros(9, 9, dtype=torch.bool)
        for start, n in ((0, 3), (3, 2), (5, 4)):
            expected[start : start + n, start : start + n] = torch.ones(
                n, n, dtype=torch.bool
            ).tril()
        assert torch.equal(mask, expected)

    def test_window_limits_each_query_to_window_tokens_including_itself(self) -> None:
        mask = build_packed_metadata([5], "cpu").dense_mask(2, CPU)[0, 0]
        # transformers' sliding_window=2: token i sees i-1 and i
        expected = torch.ones(5, 5, dtype=torch.bool).tril() & ~torch.ones(
            5, 5, dtype=torch.bool
        ).tril(-2)
        assert torch.equal(mask, expected)
        assert mask.sum().item() == 9

    def test_additive_mask_is_zero_where_allowed_and_minus_inf_elsewhere(self) -> None:
        meta = build_packed_metadata([2, 2], "cpu")
        add = meta.additive_mask(None, CPU, torch.float32)[0, 0]
        assert torch.equal(add == 0, meta.dense_mask(None, CPU)[0, 0])
        assert torch.isinf(add[~meta.dense_mask(None, CPU)[0, 0]]).all()

    def test_model_kwargs_carry_positions_and_the_object_itself(self) -> None:
        meta = build_packed_metadata([2, 3], "cpu")
        kwargs = meta.model_kwargs()
        assert set(kwargs) == {"position_ids", "packed_metadata"}
        assert (
            kwargs["packed_metadata"] is meta
            and kwargs["position_ids"] is meta.position_ids
        )

    @pytest.mark.parametrize(
        ("lengths", "error", "message"),
        [
            ([], ValueError, "empty"),
            ([3, 0, 2], ValueError, ">= 1"),
            (torch.tensor([3, 2]), TypeError, "host-side Python ints"),
        ],
    )
    def test_bad_lengths_are_refused_with_the_fix(
        self, lengths, error, message
    ) -> None:
        with pytest.raises(error, match=message):
            build_packed_metadata(lengths, "cpu")

    def test_unknown_backend_is_refused(self) -> None:
        with pytest.raises(ValueError, match="not one of"):
            build_packed_metadata([2], "cpu", backend="flash_attention_2")


class TestCache:
    def test_each_structure_is_built_once_per_window(self) -> None:
        meta = build_packed_metadata([3, 2, 4], "cpu")
        first = meta.dense_mask(None, CPU)
        for _ in range(5):
            assert meta.dense_mask(None, CPU) is first
            meta.dense_mask(2, CPU)
            meta.varlen(CPU)
        assert meta.counter.metadata == 1
        assert dict(meta.counter.structures) == {
            ("dense_mask", None, CPU): 1,
            ("dense_mask", 2, CPU): 1,
            ("varlen", None, CPU): 1,
        }
        assert meta.layer_view(meta.position_ids) is meta

    def test_varlen_pair_is_the_int32_offsets_and_a_python_int(self) -> None:
        cu, max_len = build_packed_metadata([7, 1], "cpu").varlen(CPU)
        assert cu.tolist() == [0, 7, 8] and cu.dtype == torch.int32
        assert max_len == 7 and type(max_len) is int

    def test_flex_block_mask_matches_the_dense_mask(self) -> None:
        pytest.importorskip("torch.nn.attention.flex_attention")
        meta = build_packed_metadata([70, 30, 100, 56], "cpu")
        for window in (None, 40):
            block = meta.block_mask(window, CPU)
            dense = (
                block.to_dense()
            )  # block granularity: True for every block with any allowed entry
            q_blocks, k_blocks = dense.shape[-2:]
            size = block.BLOCK_SIZE[0]
            exact = meta.dense_mask(window, CPU)[0, 0]
            padded = torch.zeros(q_blocks * size, k_blocks * size, dtype=torch.bool)
            padded[: meta.total, : meta.total] = exact
            any_allowed = padded.view(q_blocks, size, k_blocks, size).any(dim=(1, 3))
            assert torch.equal(dense[0, 0].bool(), any_allowed)


class TestUncachedTwin:
    def test_rebuilds_the_same_metadata_from_device_positions_every_call(self) -> None:
        lengths = [3, 2, 4, 1]
        cached = build_packed_metadata(lengths, "cpu")
        off = build_packed_metadata(lengths, "cpu", cache=False)
        assert isinstance(off, UncachedPackedMetadata)
        assert off.counter.metadata == 0
        views = [off.layer_view(off.position_ids) for _ in range(3)]
        assert off.counter.metadata == 3
        assert views[0] is not views[1]
        for view in views:
            assert view.lengths == cached.lengths
            assert view.max_seqlen == cached.max_seqlen
            assert torch.equal(view.cu_seqlens, cached.cu_seqlens)
            assert torch.equal(view.segment_ids, cached.segment_ids)
            assert torch.equal(view.position_ids, cached.position_ids)
            assert torch.equal(view.dense_mask(3, CPU), cached.dense_mask(3, CPU))
        # every view built its own mask: the "before" that the cache removes
        assert off.counter.structures[("dense_mask", 3, CPU)] == 3

    def test_without_position_ids_it_says_what_to_pass(self) -> None:
        off = build_packed_metadata([2, 2], "cpu", cache=False)
        with pytest.raises(ValueError, match="model_kwargs"):
            off.layer_view(None)


class TestWithThePacker:
    def test_positions_match_the_packed_batch_built_from_the_same_samples(self) -> None:
        from trainer.data.dataset import Sample
        from trainer.data.packing import pack_batch

        samples = [Sample(list(range(n)), list(range(n))) for n in (3, 2, 4)]
        batch = pack_batch(samples)
        meta = build_packed_metadata(batch.lengths, "cpu")
        assert torch.equal(meta.position_ids, batch.position_ids)
        assert (
            meta.total == batch.num_tokens and meta.num_samples == batch.num_sequences
        )


class TestSharedPrefixes:
    """GRPO's shared prompts: a sample that names an earlier one as its prefix sees all of it."""

    def test_positions_continue_the_prefix_and_the_rows_name_it(self) -> None:
        meta = build_packed_metadata([3, 2, 2, 1], "cpu", prefixes=[-1, 0, 0, -1])
        assert meta.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 0]]
        assert meta.prefix_of == (-1, 0, 0, -1)
        # (prefix start, prefix length, query end): the prefix's keys are seen up to row 7
        assert meta.prefix_rows(CPU).tolist() == [[0, 0, 7], [0, 3, 5], [0, 3, 7], [0, 0, 8]]
        assert meta.prefix_rows(CPU).dtype == torch.int32
        assert build_packed_metadata([3, 2], "cpu").prefix_rows(CPU) is None

    def test_dense_mask_adds_the_whole_prefix_to_each_sharing_sample(self) -> None:
        mask = build_packed_metadata([3, 2, 2], "cpu", prefixes=[-1, 0, 0]).dense_mask(None, CPU)[0, 0]
        expected = torch.zeros(7, 7, dtype=torch.bool)
        for start, n in ((0, 3), (3, 2), (5, 2)):
            expected[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        expected[3:7, 0:3] = True  # both completions see the whole prompt, not each other
        assert torch.equal(mask, expected)

    def test_flex_block_mask_matches_the_dense_mask(self) -> None:
        pytest.importorskip("torch.nn.attention.flex_attention")
        meta = build_packed_metadata([100, 70, 30, 56, 200], "cpu", prefixes=[-1, 0, 0, -1, 3])
        block = meta.block_mask(None, CPU)
        dense = block.to_dense()
        q_blocks, k_blocks = dense.shape[-2:]
        size = block.BLOCK_SIZE[0]
        padded = torch.zeros(q_blocks * size, k_blocks * size, dtype=torch.bool)
        padded[: meta.total, : meta.total] = meta.dense_mask(None, CPU)[0, 0]
        assert torch.equal(dense[0, 0].bool(), padded.view(q_blocks, size, k_blocks, size).any(dim=(1, 3)))

    @pytest.mark.parametrize(
        ("prefixes", "message"),
        [
            ([-1, 0], "one per sample"),
            ([1, -1, -1], "earlier sample"),
            ([-1, 0, 1], "no prefix itself"),
            ([-1, -1, 0], "follow it, contiguous"),
        ],
    )
    def test_prefixes_that_are_not_earlier_contiguous_samples_are_refused(self, prefixes, message) -> None:
        with pytest.raises(ValueError, match=message):
            build_packed_metadata([2, 2, 2], "cpu", prefixes=prefixes)

    @pytest.mark.parametrize(("backend", "cache"), [("sdpa", False), ("triton", False)])
    def test_a_backend_or_cache_that_cannot_take_prefixes_says_so(self, backend, cache) -> None:
        with pytest.raises(ValueError, match="shared prefixes need the metadata cache"):
            build_packed_metadata([2, 2], "cpu", backend=backend, cache=cache, prefixes=[-1, 0])

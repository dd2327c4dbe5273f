import struct
from collections import namedtuple

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from weightsync.plan.buckets import ALIGN, metadata_digest, plan_buckets
from weightsync.protocol import ParamMeta
from weightsync.reshard.packing import CHUNK_BYTES, ROW_WORDS, fold_checksum, pack, unpack

MiB = 1 << 20


def metas(*specs):
    return [ParamMeta(f"t{i}", dt, shape) for i, (dt, shape) in enumerate(specs)]


def test_buckets_are_aligned_bounded_and_in_order():
    ms = metas((torch.float32, (10, 10)), (torch.bfloat16, (3,)), (torch.float32, (100,)), (torch.int64, (7, 2)))
    buckets = plan_buckets(ms, 1024)
    # t0: 400 B at 0; t1: 6 B at 512; t2: 400 B would end at 1168 > 1024 -> new bucket; t3 at 512
    assert [[(e.name, e.offset, e.nbytes) for e in b.entries] for b in buckets] == [
        [("t0", 0, 400), ("t1", 512, 6)], [("t2", 0, 400), ("t3", 512, 112)]]
    assert [b.nbytes for b in buckets] == [518, 624]
    assert all(e.offset % ALIGN == 0 for b in buckets for e in b.entries)


def test_tensor_larger_than_bucket_is_rejected_by_name():
    with pytest.raises(ValueError, match=r"parameter 't1' has 4096 bytes, more than bucket_bytes=1024"):
        plan_buckets(metas((torch.float32, (4,)), (torch.float32, (1024,))), 1024)


def test_bucket_bytes_validated():
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 256, got 10"):
        plan_buckets([], 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float8_e4m3fn])
def test_pack_unpack_roundtrip_is_bit_exact(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "noncontig": torch.randn(3, 5, generator=g).to(dtype).t(),  # (5, 3), not contiguous
        "vec": torch.randn(7, generator=g).to(dtype),
        "empty": torch.empty(0, 4, dtype=dtype),
        "cube": torch.randn(2, 2, 2, generator=g).to(dtype),
    }
    ms = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    (bucket,) = plan_buckets(ms, 4096)
    buf = torch.full((4096,), 0xAB, dtype=torch.uint8)
    for e, t in zip(bucket.entries, tensors.values()):
        pack(buf, e, t)
    out = dict(unpack(buf, bucket))
    assert list(out) == list(tensors)
    for name, want in tensors.items():
        got = out[name]
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def test_digest_depends_on_order_names_dtypes_shapes():
    base = [ParamMeta("a", torch.float32, (2,)).wire(), ParamMeta("b", torch.bfloat16, (3, 4)).wire()]
    d = metadata_digest(base)
    assert d == metadata_digest([dict(x) for x in base])
    assert d != metadata_digest(base[::-1])
    assert d != metadata_digest([base[0], dict(base[1], dtype="float16")])
    assert d != metadata_digest([base[0], dict(base[1], shape=[4, 3])])


def test_plan_buckets_takes_plain_records_with_dtype_names():
    Meta = namedtuple("Meta", "name dtype shape")
    plain = [Meta("t0", "float32", (10, 10)), Meta("t1", "torch.bfloat16", (3,))]
    typed = metas((torch.float32, (10, 10)), (torch.bfloat16, (3,)))
    assert plan_buckets(plain, 1024) == plan_buckets(typed, 1024)
    with pytest.raises(ValueError, match=r"parameter 'x': dtype 'qint4' has no known itemsize"):
        plan_buckets([Meta("x", "qint4", (2,))], 1024)


# --- fold_checksum -------------------------------------------------------------------------------


def _reference_fold(acc: int, data: bytes) -> int:
    """The definition in weightsync.reshard.packing's docstring, in plain Python."""
    padded = data + bytes(-len(data) % (4 * ROW_WORDS))
    words = struct.unpack(f"<{len(padded) // 4}i", padded)
    a = sum(words)
    r = sum((i // ROW_WORDS + 1) * x for i, x in enumerate(words))
    c = sum((i % ROW_WORDS + 1) * x for i, x in enumerate(words))
    for value in (len(data), a, r, c):
        acc = (acc * 1_000_003 + value) % ((1 << 61) - 1)
    return acc


def _peak_cpu_bytes(fn) -> int:
    """Peak of the running sum of CPU allocator events while ``fn`` runs (allocations minus frees)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def test_peak_measurement_sees_transient_allocations():
    x = torch.zeros(4 * MiB, dtype=torch.uint8)
    assert _peak_cpu_bytes(lambda: x.to(torch.int64).sum()) >= 32 * MiB


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_checksum_peak_memory_is_bounded_by_two_chunks(layout):
    g = torch.Generator().manual_seed(0)
    t = torch.randint(-(2**31), 2**31 - 1, (4096, 4096), dtype=torch.int32, generator=g)  # 64 MiB
    if layout == "transposed":
        t = t.t()
    peak = _peak_cpu_bytes(lambda: fold_checksum(0, t))
    assert peak <= 2 * CHUNK_BYTES, f"fold_checksum of {t.nbytes // MiB} MiB peaked at {peak / MiB:.1f} MiB"


@pytest.mark.parametrize("nbytes", [0, 1, 5, 4 * ROW_WORDS, 4 * ROW_WORDS * 3 + 7])
def test_checksum_matches_its_definition(nbytes):
    data = bytes((i * 7 + 3) % 256 for i in range(nbytes))
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    assert fold_checksum(12345, t) == _reference_fold(12345, data)


def test_checksum_depends_on_bytes_not_strides_alignment_or_chunks():
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 256, (CHUNK_BYTES + 3 * ROW_WORDS + 5,), dtype=torch.uint8, generator=g)
    want = fold_checksum(7, base)
    buf = torch.empty(base.numel() + 1, dtype=torch.uint8)
    buf[1:] = base
    assert fold_checksum(7, buf[1:]) == want  # misaligned for an int32 view
    wide = base[: base.numel() // 6 * 6].view(-1, 3)
    assert fold_checksum(7, wide.t().contiguous().t()) == fold_checksum(7, wide)  # strided, same bytes
    bf = torch.randn(300, 70, generator=g).to(torch.bfloat16)
    assert fold_checksum(0, bf[:, 5:9]) == fold_checksum(0, bf[:, 5:9].contiguous())


def test_checksum_is_order_and_position_sensitive():
    g = torch.Generator().manual_seed(2)
    t = torch.randint(0, 256, (4 * ROW_WORDS * 3 + 11,), dtype=torch.uint8, generator=g)
    want = fold_checksum(0, t)
    for i, j in [(0, 1), (0, 4), (4, 8 * ROW_WORDS), (3, t.numel() - 1)]:  # in a word, a row, rows, the tail
        s = t.clone()
        s[i], s[j] = t[j], t[i]
        assert s[i] != s[j] or t[i] == t[j]
        if t[i] != t[j]:
            assert fold_checksum(0, s) != want, (i, j)
    assert fold_checksum(0, torch.cat([t, torch.zeros(1, dtype=torch.uint8)])) != want  # a zero is not padding
    a, b = t[:100], t[100:]
    assert fold_checksum(fold_checksum(0, a), b) != fold_checksum(fold_checksum(0, b), a)
    assert fold_checksum(1, t) != want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checksum_is_equal_on_cpu_and_cuda():
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 256, (CHUNK_BYTES + 12345,), dtype=torch.uint8, generator=g)
    assert fold_checksum(5, t.cuda()) == fold_checksum(5, t)
    m = torch.randn(1000, 300, generator=g).to(torch.bfloat16)
    assert fold_checksum(5, m.cuda()[:, 3:77]) == fold_checksum(5, m[:, 3:77])

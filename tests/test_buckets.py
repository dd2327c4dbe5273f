import pytest
import torch

from weightsync.buckets import ALIGN, metadata_digest, pack, plan_buckets, unpack
from weightsync.protocol import ParamMeta


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

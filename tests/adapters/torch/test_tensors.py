"""Tensor leaves: every dtype, views and non-contiguous tensors, bit-exact both ways."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from torch_helpers import bits, same_bits

import pitstop
from pitstop.adapters.torch import TensorLeaf, numpy_dtype

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.complex64, torch.complex128, torch.bool, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
          torch.uint64]


def random_bits(shape, dtype, seed=0):
    """A tensor whose bytes are random (NaN payloads, subnormals, every bit pattern)."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if shape else 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact(manager, dtype):
    src = {"a": random_bits((3, 5), dtype), "scalar": random_bits((), dtype, 1),
           "empty": torch.empty(0, 4, dtype=dtype)}
    mgr = manager()
    mgr.save(1, src)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    assert mgr.restore(dst) == 1
    for k in src:
        assert same_bits(src[k], dst[k]), k
    # the manifest records the dtype numpy/ml_dtypes would name; load() gives numpy arrays
    loaded = mgr.load()
    assert loaded["a"].dtype == numpy_dtype(dtype)
    assert loaded["a"].tobytes() == bits(src["a"]).numpy().tobytes()


def test_views_and_non_contiguous_sources(manager):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    bf = torch.randn(8, 6).to(torch.bfloat16)
    src = {"t": base.t(), "step": base[::2, 1::3], "row": base[3], "bf_t": bf.t(),
           "expand": torch.arange(3.0).expand(4, 3), "conj": torch.randn(3, dtype=torch.cfloat).conj()}
    mgr = manager()
    mgr.save(1, src)
    dst = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in src.items()}
    mgr.restore(dst)
    for k in src:
        assert same_bits(src[k].resolve_conj(), dst[k]), k


def test_restore_into_non_contiguous_targets(manager):
    """Targets that are views (transposed, strided, offset) are written through in place."""
    src = {"a": torch.randn(4, 6), "b": torch.randn(5).to(torch.bfloat16)}
    mgr = manager()
    mgr.save(1, src)
    big = torch.zeros(6, 4)
    holder = torch.zeros(12, dtype=torch.bfloat16)
    dst = {"a": big.t(), "b": holder[1::2][:5]}
    assert not dst["a"].is_contiguous() and not dst["b"].is_contiguous()
    mgr.restore(dst)
    assert torch.equal(big.t(), src["a"])
    assert same_bits(holder[1::2][:5], src["b"])
    assert torch.count_nonzero(holder[0::2]) == 0  # nothing written outside the view


def test_leaf_is_a_reference_not_a_copy():
    t = torch.zeros(4)
    leaf = TensorLeaf(t)
    view = leaf.host_view()
    assert view is not None and view.flags.writeable
    view[:] = 7
    assert torch.all(t == 7)  # restore streams straight into the tensor's storage
    out = np.empty(4, np.float32)
    t.add_(1)
    leaf.snapshot_into(out)
    assert (out == 8).all()  # the snapshot reads the live value at snapshot time


def test_bfloat16_leaf_uses_ml_dtypes():
    leaf = TensorLeaf(torch.ones(2, dtype=torch.bfloat16))
    assert leaf.dtype == np.dtype(ml_dtypes.bfloat16)
    assert leaf.host_view().dtype == np.dtype(ml_dtypes.bfloat16)


def test_parameters_with_grad_are_restored_in_place(manager):
    p = torch.nn.Parameter(torch.randn(3, 3))
    mgr = manager()
    mgr.save(1, {"p": p})
    q = torch.nn.Parameter(torch.zeros(3, 3))
    ptr = q.data_ptr()
    mgr.restore({"p": q})
    assert torch.equal(p, q) and q.data_ptr() == ptr and q.requires_grad


UNSUPPORTED = [
    (lambda: torch.zeros(2, dtype=torch.complex32), "complex32"),
    (lambda: torch.zeros(2, 2).to_sparse(), "layout"),
    (lambda: torch.empty(2, device="meta"), "meta"),
    (lambda: torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.quint8), "quantized"),
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make,match", UNSUPPORTED)
def test_unsupported_tensors_say_what_to_do(manager, make, match):
    with pytest.raises(pitstop.UnsupportedStateError, match=match) as e:
        manager().save(1, {"bad": make()})
    # placed in the state directly, the tensor has no name of its own: "this tensor"
    assert "this tensor" in str(e.value) and "tensor ''" not in str(e.value), str(e.value)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make,match", UNSUPPORTED)
def test_unsupported_tensors_inside_objects_are_named(make, match):
    """Inside a module or an optimizer the message names the key within it."""
    from pitstop.adapters.torch._adapter import ModuleAdapter, OptimizerAdapter

    m = torch.nn.Linear(2, 2)
    m.register_buffer("odd", make())
    with pytest.raises(pitstop.UnsupportedStateError, match=match) as e:
        ModuleAdapter().capture(m)
    assert "tensor 'odd'" in str(e.value), str(e.value)

    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt.state[m.weight]["odd"] = make()
    with pytest.raises(pitstop.UnsupportedStateError, match=match) as e:
        OptimizerAdapter().capture(opt)
    assert "tensor 'state/0/odd'" in str(e.value), str(e.value)


def test_restoring_into_an_expanded_tensor_is_refused_before_writing(manager):
    """Its rows share memory: writing element by element would leave the last row in every
    row, silently. Refused up front (check_restorable, for the core's pre-restore checks)
    and by assign itself."""
    target = torch.zeros(1, 2).expand(3, 2)
    leaf = TensorLeaf(target)
    with pytest.raises(pitstop.UnsupportedStateError, match="owns its memory"):
        leaf.check_restorable()
    with pytest.raises(pitstop.UnsupportedStateError, match="this tensor"):
        leaf.assign(np.arange(6, dtype=np.float32).reshape(3, 2))
    assert torch.count_nonzero(target) == 0  # nothing was written
    for fine in (torch.zeros(3, 2), torch.zeros(2, 3).t(), torch.zeros(6)[::2],
                 torch.zeros(1, 2).expand(1, 2), torch.zeros(3, 1).expand(3, 1)):
        TensorLeaf(fine).check_restorable()

    mgr = manager()
    mgr.save(1, {"t": torch.arange(6.0).reshape(3, 2)})
    with pytest.raises(pitstop.CheckpointError, match="owns its memory"):
        mgr.restore({"t": target})
    assert torch.count_nonzero(target) == 0


def test_an_expanded_target_leaves_the_rest_of_the_state_untouched(manager):
    mgr = manager()
    mgr.save(1, {"a": torch.ones(4), "t": torch.arange(6.0).reshape(3, 2)})
    target = {"a": torch.zeros(4), "t": torch.zeros(1, 2).expand(3, 2)}
    with pytest.raises(pitstop.CheckpointError, match="owns its memory"):
        mgr.restore(target)
    assert torch.count_nonzero(target["a"]) == 0


def test_inference_tensors_are_restored_also_through_a_copy(manager):
    """A conjugate view is written with Tensor.copy_ (as every CUDA tensor is), which an
    inference tensor takes only inside inference mode."""
    src = {"a": torch.arange(4.0), "c": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)}
    mgr = manager()
    mgr.save(1, src)
    with torch.inference_mode():
        a, c = torch.zeros(4), torch.zeros(2, dtype=torch.complex64)
    mgr.restore({"a": a, "c": c.conj()})
    assert torch.equal(a, src["a"]) and torch.equal(c.conj(), src["c"])


def test_shape_mismatch_is_reported_by_name(manager):
    mgr = manager()
    mgr.save(1, {"w": torch.zeros(3), "v": torch.zeros(2)})
    with pytest.raises(pitstop.IncompatibleTargetError, match=r"w.*float32\[3\].*float32\[4\]"):
        mgr.restore({"w": torch.zeros(4), "v": torch.ones(2)})
    target = {"w": torch.full((4,), 5.0), "v": torch.ones(2)}
    r = mgr.restore(target, strict=False)
    assert r == 1 and r.mismatched_keys == ["w"]
    assert torch.all(target["w"] == 5) and torch.all(target["v"] == 0)  # the rest was loaded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_round_trip_through_pinned_staging(manager):
    dev = torch.device("cuda")
    src = {"w": torch.randn(64, 33, device=dev).t(), "b": torch.randn(7, device=dev).to(torch.bfloat16),
           "f8": torch.randn(9, device=dev).to(torch.float8_e4m3fn)}
    expected = {k: v.cpu().clone() for k, v in src.items()}
    mgr = manager(async_save=True)
    h = mgr.save(1, src)
    assert torch.from_numpy(mgr.pool.buffers[0].buf).is_pinned()  # page-locked staging
    src["w"].zero_()  # the snapshot was taken before save() returned: later writes don't leak
    src["b"].zero_()
    h.result()
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    mgr.restore(dst)
    for k, v in dst.items():
        assert v.device.type == "cuda" and same_bits(v.cpu(), expected[k]), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_hook_page_locks():
    from pitstop.adapters.torch._leaf import pin_staging
    from pitstop.core.adapter import staging_hooks
    assert pin_staging in staging_hooks
    torch.zeros(1, device="cuda")  # CUDA in use
    buf = np.zeros(1 << 20, np.uint8)
    pin_staging(buf)
    t = torch.from_numpy(buf)
    assert t.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inference_and_expanded_targets(manager):
    mgr = manager()
    mgr.save(1, {"a": torch.arange(4.0), "t": torch.arange(6.0).reshape(3, 2)})
    with torch.inference_mode():
        a = torch.zeros(4, device="cuda")
    mgr.restore({"a": a, "t": torch.zeros(3, 2, device="cuda")})
    assert torch.equal(a.cpu(), torch.arange(4.0))
    expanded = torch.zeros(1, 2, device="cuda").expand(3, 2)
    with pytest.raises(pitstop.CheckpointError, match="owns its memory"):
        mgr.restore({"a": torch.zeros(4, device="cuda"), "t": expanded})
    assert torch.count_nonzero(expanded) == 0

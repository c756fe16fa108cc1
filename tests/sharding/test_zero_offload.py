"""CPU offload (ZeRO-Offload): offloaded runs train like the non-offloaded engine and the single-process
reference; the optimizer's buffers are accounted to host memory; checkpoints move across offload settings.

On a CPU-only machine the "device" is the CPU too, but every offloaded buffer is a separate host
tensor and every copy between them runs (see [Note: offload] in sharding/offload.py).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from tests.sharding.test_zero_equivalence import assert_states_close, assert_trains_like
from tests.support.offload_cases import checkpoint_across_offload, offload_matrix
from tests.support.zero_cases import STEPS
from tests.support.zero_models import make_model, make_optimizer, train_reference
from tnlg.sharding import ZeroConfig, initialize, offload
from tnlg.sharding.kernels import CPUAdam
from tnlg.sharding.offload import Placement, host_adam_for
from tnlg.tools.spawn import run_distributed

STAGES = (1, 2, 3)


@pytest.fixture(scope="module", params=(1, 2), ids=lambda n: f"world{n}")
def world(request):
    return request.param, run_distributed(offload_matrix, request.param, timeout=900)[0]


@pytest.fixture(scope="module")
def reference():
    return train_reference(STEPS)


def assert_same_run(run, other, rel=1e-6, atol=1e-6):
    """Two engine runs agree: CPUAdam and torch's Adam differ by float rounding only (~5e-8)."""
    assert run["losses"] == pytest.approx(other["losses"], rel=rel)
    assert run["skipped"] == other["skipped"]
    assert_states_close(run["state"], {k: v.float() for k, v in other["state"].items()}, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fp32", "accumulate", "accumulate-synced"])
@pytest.mark.parametrize("stage", STAGES)
def test_offloaded_optimizer_equals_single_process(world, reference, stage, case):
    run = world[1][(case, stage)]
    assert_trains_like(run, reference)
    assert run["norms"] == pytest.approx(reference[2], rel=1e-5)


@pytest.mark.parametrize("stage", STAGES)
def test_offloaded_clipping_equals_clip_grad_norm(world, stage):
    clipped = train_reference(STEPS, clip=0.05)
    run = world[1][("clip", stage)]
    assert max(clipped[2]) > 0.05  # clipping was active
    assert run["norms"] == pytest.approx(clipped[2], rel=1e-5)
    assert_trains_like(run, clipped)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
def test_offloaded_16bit_training_equals_the_device_engine(world, stage, precision):
    """CPUAdam writes the 16-bit parameters itself, rounded as the device step casts them. Its fp32
    master differs from torch's by float rounding (~5e-8), which now and then lands a 16-bit copy on
    the other side of a rounding boundary: after 10 steps that stays within 1e-5."""
    results = world[1]
    assert_same_run(results[(precision, stage)], results[(f"{precision}-device", stage)], rel=1e-5, atol=1e-5)


@pytest.mark.parametrize("stage", STAGES)
def test_other_optimizers_step_the_host_master_themselves(world, stage):
    results = world[1]
    assert_same_run(results[("sgd", stage)], results[("sgd-device", stage)])
    assert results[("sgd", stage)]["losses"][-1] < results[("sgd", stage)]["losses"][0]


def test_adam_with_coupled_weight_decay(world):
    results = world[1]
    assert_same_run(results[("adam", 2)], results[("adam-device", 2)])


@pytest.mark.parametrize("case", ["param", "both", "both-accumulate", "both-keep-gathered"])
def test_offloaded_parameters_equal_single_process(world, reference, case):
    assert_trains_like(world[1][(case, 3)], reference)


def test_offloaded_parameters_in_bf16(world):
    results = world[1]
    assert_same_run(results[("param-bf16", 3)], results[("bf16-device", 3)], rel=0, atol=0)  # no step change
    assert_same_run(results[("both-bf16", 3)], results[("bf16-device", 3)], rel=1e-5, atol=1e-5)


def test_fp16_overflow_skips_alike_when_offloaded(world):
    run = world[1][("fp16-overflow", 2)]
    skipped = sum(run["skipped"])
    assert run["skipped"][0] and 0 < skipped < STEPS
    assert run["scales"][-1] == 2.0 ** (16 - skipped)
    assert run["losses"][-1] < run["losses"][skipped]


def test_memory_is_accounted_to_host_and_device(world):
    results = world[1]
    for stage in STAGES:
        device_run, run = results[("bf16-device", stage)]["memory"], results[("bf16", stage)]["memory"]
        assert device_run["host"] == 0 and device_run["device"] == device_run["total"]
        host_grads = run["grads"] if stage >= 2 else 0  # stage 1 keeps its full gradients on the device
        # the host also holds the 16-bit copy CPUAdam writes (counted with the parameters)
        copy = run["master"] // 2
        # stage 1 on several ranks copies its 16-bit gradient shard out of the full gradient into a host
        # buffer it keeps for CPUAdam to read (on one rank the full gradient is the shard, read in place)
        step_gradient = run["master"] // 2 if stage == 1 and world[0] > 1 else 0
        assert run["host"] == run["master"] + run["optimizer_state"] + host_grads + copy + step_gradient
        assert run["device"] == run["params"] - copy + run["grads"] - host_grads - step_gradient
        assert run["device"] < device_run["device"]
    both = results[("both-bf16", 3)]["memory"]
    # stage 3 with everything offloaded: on the device, only the small persistent parameters
    # (this tiny model's norms and biases) remain between steps
    assert both["host"] == both["master"] + both["optimizer_state"] + both["grads"] + both["master"] // 2
    assert both["device"] == both["params"] - both["master"] // 2


@pytest.mark.slow
def test_checkpoints_move_across_offload_settings(tmp_path):
    result = run_distributed(checkpoint_across_offload, 2, str(tmp_path / "ckpt"))[0]
    whole = result["whole"]
    assert result["offloaded"]["losses"] == whole["losses"][3:]  # bit for bit: CPUAdam is deterministic
    for name, tensor in whole["state"].items():
        assert (result["offloaded"]["state"][name] == tensor).all(), name
    for other in ("on-device", "both"):  # torch's AdamW after CPUAdam: float rounding apart
        assert result[other]["losses"] == pytest.approx(whole["losses"][3:], rel=1e-6)
        assert_states_close(result[other]["state"], whole["state"], atol=1e-6)


def test_adam_steps_through_cpu_adam_and_a_scheduler_sees_the_step():
    """The user's AdamW keeps its param groups, state and step hooks; a scheduler built on it
    turns the learning rate, and no 'lr_scheduler.step() before optimizer.step()' warning is raised."""
    model = make_model()
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    engine = initialize(model, optimizer, ZeroConfig(stage=2, offload_optimizer="cpu"))
    assert isinstance(engine.optimizer.host_adam, CPUAdam)
    calls = []
    optimizer.register_step_post_hook(lambda *args: calls.append(1))
    ids = torch.randint(0, 37, (4, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            engine.backward(engine(ids, ids))
            engine.step()
            scheduler.step()
    assert calls == [1, 1]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)
    state = optimizer.state_dict()["state"]
    assert [int(s["step"]) for s in state.values()] == [2, 2]
    # the state dict is torch's: it loads into a plain AdamW over tensors of the shards' shapes
    plain = torch.optim.AdamW([{"params": [g.master.clone()]} for g in engine.groups])
    plain.load_state_dict(optimizer.state_dict())
    torch.testing.assert_close(
        plain.state[plain.param_groups[0]["params"][0]]["exp_avg"], state[0]["exp_avg"]
    )


@pytest.mark.parametrize(
    "optimizer, fused",
    [
        (lambda params: torch.optim.AdamW(params), True),
        (lambda params: torch.optim.Adam(params, weight_decay=0.1), True),
        (lambda params: CPUAdam(params), True),
        (lambda params: torch.optim.AdamW(params, maximize=True), False),
        (lambda params: torch.optim.AdamW(params, lr=torch.tensor(1e-3)), False),
        (lambda params: torch.optim.SGD(params, lr=0.1), False),
    ],
    ids=["adamw", "adam", "cpu-adam", "maximize", "tensor-lr", "sgd"],
)
def test_which_optimizers_step_through_cpu_adam(optimizer, fused):
    params = [torch.zeros(3, requires_grad=True)]
    assert (host_adam_for(optimizer(params)) is not None) is fused


@pytest.fixture
def page_locks(monkeypatch):
    """CUDA's page locking, recorded instead (on CPU): what `pinned_host` registers and releases."""
    calls = []
    monkeypatch.setattr(
        offload, "_page_lock", lambda address, nbytes: calls.append(("lock", address, nbytes))
    )
    monkeypatch.setattr(offload, "_page_unlock", lambda address: calls.append(("unlock", address)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    return calls


@pytest.mark.parametrize(
    ("numel", "dtype"), [(1, torch.bfloat16), (1_000_003, torch.bfloat16), (4099, torch.float32)]
)
def test_buffers_for_a_cuda_device_are_pinned_at_their_exact_size(page_locks, numel, dtype):
    """Not rounded up to a power of two as torch's pinned allocator would (2 MB for the 1_000_003 bf16
    elements, not 2**21 bytes), and released only when the last view of the buffer is gone, after
    the device has finished its copies."""
    placement = Placement(torch.device("cuda", 0), optimizer_on_host=True)
    buffer = placement.host_zeros(numel, dtype)
    nbytes = numel * buffer.element_size()
    assert page_locks == [("lock", buffer.data_ptr(), nbytes)]
    assert buffer.shape == (numel,) and buffer.dtype == dtype and not buffer.any()
    assert buffer.untyped_storage().nbytes() == nbytes
    last = buffer[-1:]
    address = buffer.data_ptr()
    del buffer
    gc.collect()
    assert len(page_locks) == 1  # a view still reads it
    del last
    gc.collect()
    assert page_locks[1:] == [("synchronize", torch.device("cuda", 0)), ("unlock", address)]


def test_host_buffers_on_a_cpu_only_machine_and_unpinned_ones_are_plain_tensors(page_locks):
    on_cpu = Placement(torch.device("cpu"), optimizer_on_host=True)
    on_cuda = Placement(torch.device("cuda", 0), optimizer_on_host=True)
    buffers = [
        on_cpu.host_zeros(10, torch.float32),
        on_cpu.host_empty(10, torch.bfloat16),
        on_cuda.host_zeros(10, torch.float32, transfer=False),  # the master: only the CPU reads it
        on_cuda.host_empty(0, torch.bfloat16),
    ]
    assert [b.numel() for b in buffers] == [10, 10, 10, 0]
    assert not buffers[0].any()
    assert page_locks == []


@pytest.mark.gpu
def test_pinned_host_buffers_lock_exactly_their_bytes():
    numel = (1 << 20) + 3  # fp32: 4 MiB + 12 bytes, which torch's pinned allocator would make 8 MiB
    stats = getattr(torch.cuda.memory, "host_memory_stats", dict)  # torch's pinned allocator, where it says
    before = stats().get("allocated_bytes.all.current", 0)
    buffer = Placement(torch.device("cuda", torch.cuda.current_device()), optimizer_on_host=True).host_empty(
        numel, torch.float32
    )
    assert buffer.is_pinned() and buffer[-1:].is_pinned()
    assert buffer.untyped_storage().nbytes() == numel * 4
    # none of it came from torch's caching pinned allocator
    assert stats().get("allocated_bytes.all.current", 0) == before
    source = torch.arange(numel, dtype=torch.float32, device="cuda")
    buffer.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffer, source.cpu())
    back = torch.empty_like(source)
    back.copy_(buffer, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, source)

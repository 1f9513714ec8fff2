"""State the methods of a run keep inside (mutable buffers), one copy per name across the methods, on each backend:
the eager programs (``zoo.runner.state.SharedBuffers``), torch's AOTI containers
(``zoo.runtimes.aoti.SharedConstants``, here over a stand-in container; over real CPU containers in the ``e2e``
test at the end) and the CUDA-graph replay's warm-up (``zoo.runner.graphs``).

The reference is the unit itself in eager PyTorch: two modules that register one tensor as a buffer, one writing
rows of it in place, the other attending over it (LingBot-VA's KV pool in miniature).
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zoo.core.errors import VerificationFailed
from zoo.runner.graphs import GraphReplay
from zoo.runner.state import SharedBuffers, mutated_buffers
from zoo.runtimes.aoti import SharedConstants

SLOTS, DIM = 6, 8


class Write(nn.Module):
    """Writes projected rows into the pool at host-chosen slots, in place."""

    def __init__(self, pool: torch.Tensor, proj: nn.Linear):
        super().__init__()
        self.register_buffer("pool", pool)
        self.proj = proj

    def forward(self, x, slots):
        self.pool.index_copy_(0, slots, self.proj(x))
        return self.pool.sum(0)


class WriteThroughView(Write):
    def forward(self, x, slots):
        self.pool[1:].index_copy_(0, slots, self.proj(x))
        return self.pool.sum(0)


class Read(nn.Module):
    """Attends over the whole pool; writes nothing."""

    def __init__(self, pool: torch.Tensor, proj: nn.Linear):
        super().__init__()
        self.register_buffer("pool", pool)
        self.proj = proj

    def forward(self, q):
        return torch.softmax(self.proj(q) @ self.pool.t(), dim=-1) @ self.pool


def unit():
    torch.manual_seed(0)
    pool, proj = torch.zeros(SLOTS, DIM), nn.Linear(DIM, DIM)
    return {"write": Write(pool, proj), "read": Read(pool, proj)}


X, IDX, Q = torch.randn(2, DIM), torch.tensor([1, 4]), torch.randn(3, DIM)


def programs(modules):
    """Each module exported, holding its own copy of its buffers, as a program loaded from its file does (exported
    from the one unit, the programs' buffers would still be the unit's tensors)."""
    args = {"write": (X, IDX), "read": (Q,)}
    return {m: copy.deepcopy(torch.export.export(mod, args[m])) for m, mod in modules.items()}


def eager_write_then_read():
    """The reference: the unit's own modules, which hold one pool."""
    modules = unit()
    with torch.no_grad():
        return modules["write"](X, IDX), modules["read"](Q)


# --- which buffers a program writes -------------------------------------------------------------------------------


def test_written_buffers_are_found_in_place_through_a_view_and_functionalised():
    torch.manual_seed(0)
    pool, proj = torch.zeros(SLOTS + 1, DIM), nn.Linear(DIM, DIM)
    exported = programs(unit())
    assert mutated_buffers(exported["write"]) == {"pool"}  # export IR: index_copy_ on the placeholder
    assert mutated_buffers(exported["read"]) == set()
    view = torch.export.export(WriteThroughView(pool, proj), (X, IDX))
    assert mutated_buffers(view) == {"pool"}  # index_copy_ into a slice of it
    functional = exported["write"].run_decompositions()
    assert functional.graph_signature.buffers_to_mutate and mutated_buffers(functional) == {"pool"}


# --- eager: one tensor per written buffer -------------------------------------------------------------------------


@pytest.mark.parametrize("order", [("write", "read"), ("read", "write")])
def test_eager_programs_share_the_buffer_one_of_them_writes(order):
    """Loaded in either order (the reader first: it writes nothing, yet must see what the writer writes)."""
    exported = programs(unit())
    shared, modules = SharedBuffers(), {}
    for method in order:
        modules[method] = exported[method].module()
        shared.adopt(modules[method], exported[method])
    assert modules["write"].pool is modules["read"].pool
    assert shared.unshared(modules, ["pool"]) == {}
    with torch.no_grad():
        got = modules["write"](X, IDX), modules["read"](Q)
    for a, b in zip(got, eager_write_then_read()):
        torch.testing.assert_close(a, b)


def test_eager_programs_without_sharing_read_an_empty_pool_and_say_so():
    exported = programs(unit())
    modules = {m: p.module() for m, p in exported.items()}
    problems = SharedBuffers().unshared(modules, ["pool", "absent"])
    assert "separate copies" in problems["pool"] and "holds no buffer 'absent'" in problems["absent"]
    with torch.no_grad():
        modules["write"](X, IDX)
        alone = modules["read"](Q)
    assert not torch.allclose(alone, eager_write_then_read()[1])  # what the shared pool is there to prevent


# --- torch's AOTI containers: a stand-in with the container's constant API --------------------------------------


class FakeContainer:
    """``AOTIModelContainerRunnerCuda``'s constant API over tensors: a blob file holds {FQN: tensor}."""

    def __init__(self, fqns):
        self.names = {fqn.replace(".", "_"): fqn for fqn in fqns}  # internal name -> original FQN
        self.constants = {}  # internal name -> tensor
        self.blobs_loaded, self.updates = 0, []

    def update_constant_buffer_from_blob(self, path):
        self.blobs_loaded += 1
        values = torch.load(path)
        self.constants = {name: values[fqn].clone() for name, fqn in self.names.items()}

    def get_constant_names_to_original_fqns(self):
        return dict(self.names)

    def extract_constants_map(self, use_inactive):
        return {self.names[name]: t for name, t in self.constants.items()}

    def update_constant_buffer(self, tensor_map, use_inactive, validate_full_updates, user_managed=False):
        assert not use_inactive and user_managed  # pointed at the tensors, never copied
        if validate_full_updates:
            assert set(tensor_map) == set(self.names)
        self.updates.append((sorted(tensor_map), validate_full_updates))
        self.constants.update(tensor_map)


def blob(path, **values):
    torch.save(values, path)
    return path


def test_a_method_whose_blob_is_an_earlier_ones_loads_none_and_shares_every_constant(tmp_path):
    weights = blob(tmp_path / "video_step.weights.blob", **{"w.weight": torch.ones(2, 2), "k_pool_0": torch.zeros(3)})
    os.link(weights, tmp_path / "action_step.weights.blob")  # what extraction does for one .ptd segment
    shared = SharedConstants()
    video, action = FakeContainer(["w.weight", "k_pool_0"]), FakeContainer(["w.weight", "k_pool_0"])
    shared.load("video_step", video, weights, ["k_pool_0"])
    shared.load("action_step", action, tmp_path / "action_step.weights.blob", ["k_pool_0"])
    assert (video.blobs_loaded, action.blobs_loaded) == (1, 0)
    assert action.updates == [(["k_pool_0", "w_weight"], True)]
    assert shared.unshared({"video_step": video, "action_step": action}, ["k_pool_0", "w.weight"]) == {}
    video.constants["k_pool_0"][1] = 5.0  # video_step writes its pool: action_step reads it
    assert action.extract_constants_map(False)["k_pool_0"].tolist() == [0.0, 5.0, 0.0]
    assert "every constant shared with video_step" in shared.how["action_step"]


def test_a_method_with_its_own_blob_loads_it_and_shares_only_its_state(tmp_path):
    shared = SharedConstants()
    first, second = FakeContainer(["w", "pool"]), FakeContainer(["w", "pool"])
    shared.load("write", first, blob(tmp_path / "a.blob", w=torch.ones(2), pool=torch.zeros(3)), ["pool"])
    shared.load("read", second, blob(tmp_path / "b.blob", w=torch.full((2,), 2.0), pool=torch.zeros(3)), ["pool"])
    assert second.blobs_loaded == 1 and second.updates == [(["pool"], False)]
    assert second.constants["pool"] is first.constants["pool"]
    assert second.constants["w"].tolist() == [2.0, 2.0]  # its own weights: the blobs differ
    assert "separate copies" in shared.unshared({"write": first, "read": second}, ["w"])["w"]


def test_state_of_another_shape_under_the_same_name_is_refused(tmp_path):
    shared = SharedConstants()
    shared.load("write", FakeContainer(["pool"]), blob(tmp_path / "a.blob", pool=torch.zeros(3)), ["pool"])
    with pytest.raises(VerificationFailed, match="constant 'pool' has shape"):
        shared.load("read", FakeContainer(["pool"]), blob(tmp_path / "b.blob", pool=torch.zeros(4)), ["pool"])
    assert "read" not in shared.how  # a failed load leaves nothing a later method could share


# --- the CUDA-graph replay: the warm-up before a capture leaves the state inside as it was ----------------------


class Counting(GraphReplay):
    """A step that adds its input to a buffer it keeps inside (state a method writes in place), replayed by
    GraphReplay on the CPU (where the step runs at every call, after the capture's warm-up)."""

    def __init__(self):
        self.device, self.state = torch.device("cpu"), {}
        self.total = torch.zeros(3)
        self._init_graphs()

    def method_io(self, method):
        return SimpleNamespace(inputs=[SimpleNamespace(name="x")], outputs=["total"])

    def _step(self, method, args):
        self.total.add_(args[0])
        return [self.total.clone()]

    def _inside_state(self, method):
        return [self.total]


def test_the_warm_up_before_a_capture_leaves_the_state_inside_unchanged():
    replay = Counting()
    (first,) = replay._run("step", [torch.ones(3)])
    (second,) = replay._run("step", [torch.ones(3)])
    assert first.tolist() == [1.0] * 3 and second.tolist() == [2.0] * 3  # one addition per call, warm-up undone


# --- torch's real AOTI containers (CPU): what the artifact backend does on the GPU, with the same calls ----------


def _compiled(module, args, folder):
    """``module`` compiled by AOTInductor as ExecuTorch's CUDA backend compiles a method (the weights in a blob
    of their own, not in the .so), for the CPU: (.so, weights blob) copied into ``folder``."""
    import shutil

    options = {"aot_inductor.package": True, "aot_inductor.package_constants_in_so": False,
               "aot_inductor.package_constants_on_disk_format": "binary_blob",
               "aot_inductor.compile_wrapper_opt_level": "O0"}
    program = copy.deepcopy(torch.export.export(module, args)).run_decompositions()
    with torch.no_grad():
        paths = torch._inductor.aot_compile(program.module(), args, options=options)
    folder.mkdir(parents=True, exist_ok=True)
    so = shutil.copy(next(p for p in paths if p.endswith(".wrapper.so")), folder / "method.so")
    weights = shutil.copy(next(p for p in paths if p.endswith(".blob")), folder / "method.weights.blob")
    return so, weights


@pytest.mark.e2e
def test_real_aoti_containers_share_the_state_and_one_blobs_weights(tmp_path):
    """torch's AOTI CPU container has the CUDA one's constant API (``update_constant_buffer(...,
    user_managed=True)``, ``extract_constants_map``): ``write`` then ``read`` compute what the unit computes only
    when the pool is shared; a second container over ``write``'s very blob loads nothing and reads every one of
    ``write``'s tensors."""
    from zoo.runtimes.aoti import load_weights, promote_libtorch_global

    modules = unit()
    files = {"write": _compiled(modules["write"], (X, IDX), tmp_path / "write"),
             "read": _compiled(modules["read"], (Q,), tmp_path / "read")}
    files["write2"] = files["write"]
    promote_libtorch_global()
    want_write, want_read = eager_write_then_read()
    for share in (False, True):
        shared, containers = SharedConstants(), {}
        for method, (so, weights) in files.items():
            containers[method] = torch._C._aoti.AOTIModelContainerRunnerCpu(str(so), 1)
            if share:
                shared.load(method, containers[method], weights, ["pool"])
            else:
                load_weights(containers[method], weights)
        torch.testing.assert_close(containers["write"].run([X, IDX])[0], want_write)
        read = containers["read"].run([Q])[0]
        assert torch.allclose(read, want_read, atol=1e-5) is share, "the pool was not shared" if share else read
        if share:
            assert shared.unshared(containers, ["pool"]) == {}
            assert shared.unshared({m: containers[m] for m in ("write", "write2")}, ["proj.weight"]) == {}
            assert "every constant shared with write" in shared.how["write2"]

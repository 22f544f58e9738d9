"""API semantics: gpuautograd.backward / grad behave like torch.autograd's, errors included."""

import logging

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import gpuautograd
from tests.helpers import assert_close, rand


@pytest.fixture(autouse=True)
def fresh_cache():
    gpuautograd.reset()
    yield


def graph(dtype=torch.float64):
    x = rand(5, 3, dtype=dtype)
    w = rand(3, 4, dtype=dtype, noncontiguous=True)
    b = rand(4, dtype=dtype)
    h = torch.tanh(x @ w + b)
    return (x, w, b), h


def test_backward_accumulates_like_torch_including_strides():
    (x, w, b), h = graph()
    loss = (h * h).sum()
    gpuautograd.backward(loss, retain_graph=True)
    ours = [t.grad.clone() for t in (x, w, b)]
    strides = [t.grad.stride() for t in (x, w, b)]
    gpuautograd.backward(loss, retain_graph=True)  # accumulates in place
    for t, g in zip((x, w, b), ours):
        assert_close(t.grad, 2 * g)
    for t in (x, w, b):
        t.grad = None
    loss.backward()
    for t, g, s in zip((x, w, b), ours, strides):
        assert_close(g, t.grad)
        assert s == t.grad.stride(), "the first .grad gets the strides torch would give it"


def test_accumulating_into_existing_grad_keeps_the_tensor():
    (x, w, b), h = graph()
    x.grad = torch.ones_like(x)
    held = x.grad
    gpuautograd.backward(h.sum())
    assert x.grad is held  # in place, as torch does when grad mode is off


def test_user_grad_tensor_is_never_stolen_as_grad():
    x = rand(4)
    y = x * 1.0
    g = torch.randn(4, dtype=torch.float64)
    gpuautograd.backward(y, g)
    assert x.grad is not g and torch.equal(x.grad, g)
    gpuautograd.backward(x * 1.0, g)
    assert torch.equal(g, x.grad / 2), "accumulating into x.grad must not write into the user's tensor"


def test_retain_graph_allows_a_second_backward_and_default_frees():
    (x, w, b), h = graph()
    loss = h.sum()
    gpuautograd.backward(loss, retain_graph=True)
    gpuautograd.backward(loss)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        gpuautograd.backward(loss)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()  # eager sees the release too


def test_saved_activations_are_freed_after_backward_while_loss_is_held():
    x = rand(64, 64)
    h = x.exp()  # saved by ExpBackward0 (its result) and by MulBackward0
    ref = StorageWeakRef(h.untyped_storage())
    loss = (h * h).sum()
    del h
    assert not ref.expired()
    gpuautograd.backward(loss)
    assert ref.expired(), "the saved activation must be released like eager does"
    assert loss.grad_fn is not None  # the user still holds the loss


def _freed_saved_values(root) -> list[str]:
    """Every saved tensor of the graph under `root` that reads as freed, by node name."""
    freed, seen, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
        for name in dir(node):
            if name.startswith("_raw_saved_"):
                try:
                    getattr(node, "_saved_" + name[len("_raw_saved_") :])
                except RuntimeError as e:
                    assert "second time" in str(e)
                    freed.append(f"{node.name()}.{name[len('_raw_saved_') :]}")
    return sorted(freed)


@pytest.mark.usefixtures("walker")
def test_a_hit_releases_what_eager_releases_with_none_and_listed_saved_tensors():
    # The Python walk fixes at capture which saved values to free on a hit (the key tells a None
    # apart); a plan that skipped a node, or freed a None, would show here.
    x, index, target = rand(6, 5), torch.tensor([0, 2, 2]), torch.tensor([1, 0, 4])

    def forward():
        h = x.exp()  # ExpBackward0 saves it (its result)
        logits = (h[index] * h[index].sigmoid()).log_softmax(-1)  # IndexBackward0 saves a list of index tensors
        return h, torch.nn.functional.nll_loss(logits, target)  # NllLossBackward0's weight is None

    h, loss = forward()
    loss.backward()
    eager = _freed_saved_values(loss.grad_fn)
    assert "ExpBackward0.result" in eager and "NllLossBackward0.self" in eager
    for _ in range(3):  # the capture, then hits
        h, loss = forward()
        ref = StorageWeakRef(h.untyped_storage())
        del h
        gpuautograd.backward(loss)
        assert ref.expired(), "the saved activation must be released like eager does"
        assert _freed_saved_values(loss.grad_fn) == eager
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
    assert gpuautograd.stats()["cache_hits"] == 2


def test_inputs_restricts_accumulation_and_fills_nonleaf_grads():
    (x, w, b), h = graph()
    z = h * 2
    ew, eh = torch.autograd.grad(z.sum(), [w, h], retain_graph=True)
    gpuautograd.backward(z.sum(), inputs=[w, h])
    assert x.grad is None and b.grad is None
    assert_close(w.grad, ew)
    assert_close(h.grad, eh)
    with pytest.raises(RuntimeError, match="cannot be empty"):
        gpuautograd.backward(z.sum(), inputs=[])


def test_inputs_releases_only_the_nodes_that_ran():
    (x, w, b), h = graph()
    other = (x * x).sum()  # shares x's AccumulateGrad, nothing else
    gpuautograd.backward(h.sum() + other, inputs=[b])
    (gx,) = torch.autograd.grad(other, x)  # MulBackward0 did not run, so it kept its tensors
    assert_close(gx, 2 * x.detach())


def test_retain_grad_on_nonleaf():
    (x, w, b), h = graph()
    h.retain_grad()
    gpuautograd.backward((h * 3).sum())
    assert_close(h.grad, torch.full_like(h, 3.0))


def test_grad_fires_retain_grad_like_torch():
    (x, w, b), h = graph()
    h.retain_grad()
    gpuautograd.grad((h * 3).sum(), [x], retain_graph=True)
    ours = h.grad.clone()
    h.grad = None
    torch.autograd.grad((h * 3).sum(), [x])
    assert_close(ours, h.grad)


def test_grad_returns_without_touching_dot_grad_and_allow_unused():
    (x, w, b), h = graph()
    unused = rand(2)
    gx, gu = gpuautograd.grad(h.sum(), [x, unused], retain_graph=True, allow_unused=True)
    assert gu is None and x.grad is None
    assert_close(gx, torch.autograd.grad(h.sum(), x, retain_graph=True)[0])
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        gpuautograd.grad(h.sum(), [x, unused], retain_graph=True)
    (gz,) = gpuautograd.grad(h.sum(), [unused], retain_graph=True, materialize_grads=True)
    assert torch.equal(gz, torch.zeros(2, dtype=torch.float64))


def test_errors_match_torch():
    (x, w, b), h = graph()
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        gpuautograd.backward(h)
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        gpuautograd.backward(torch.ones(()))
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        gpuautograd.backward(h, torch.ones(3))
    with pytest.raises(RuntimeError, match="does not require grad"):
        gpuautograd.grad(h.sum(), [torch.ones(3)])


def test_enable_routes_and_restores_even_on_error():
    originals = (torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward)
    (x, w, b), h = graph()
    with gpuautograd.enable():
        h.sum().backward()
        torch.autograd.grad((x * x).sum(), x)
    assert gpuautograd.stats()["captures"] == 2
    with pytest.raises(RuntimeError, match="inside the block"), gpuautograd.enable():
        raise RuntimeError("inside the block")
    assert (torch.autograd.backward, torch.autograd.grad, torch.Tensor.backward) == originals


def test_explain_reports_program_and_frees_nothing():
    (x, w, b), h = graph()
    loss = h.sum()
    report = gpuautograd.explain(loss)
    assert report.num_nodes >= 6 and report.opaque_nodes == []
    text = str(report)
    assert "def backward(" in text and "mm " in text and "TanhBackward0" in text
    loss.backward()  # the graph is intact


def test_validate_returns_errors_and_raises_with_a_table(monkeypatch):
    (x, w, b), h = graph()
    rows = gpuautograd.validate(h.sum())
    assert len(rows) == 3 and all(r.ok for r in rows)
    from gpuautograd.rules import registry

    original = registry.RULES["TanhBackward0"]
    monkeypatch.setitem(registry.RULES, "TanhBackward0", lambda bld, node, grads: [bld.mul(v, 1.5) for v in original(bld, node, grads)])
    gpuautograd.reset()
    with pytest.raises(gpuautograd.ValidationError, match=r"(?s)max abs.*FAIL"):
        gpuautograd.validate(h.sum())


def test_stats_count_hits_and_name_the_failed_guard():
    for n in (5, 5, 5, 7):
        x = rand(n, 3)
        gpuautograd.backward((x.sin() * 2).sum())
        assert_close(x.grad, 2 * x.detach().cos())
    s = gpuautograd.stats()
    assert s["captures"] == 2 and s["cache_hits"] == 2
    assert s["miss_reasons"][0] == "new graph structure"
    assert "SumBackward0" in s["miss_reasons"][1] and "(5, 3) -> (7, 3)" in s["miss_reasons"][1]


def test_recaptures_are_bounded_under_one_stable_reason(monkeypatch, caplog):
    monkeypatch.setenv("GPUAUTOGRAD_RECAPTURE_LIMIT", "2")
    with caplog.at_level(logging.WARNING, logger="gpuautograd"):
        for n in range(2, 7):
            x = rand(n)
            gpuautograd.backward(x.exp().sum())
            assert_close(x.grad, x.detach().exp())
    s = gpuautograd.stats()
    assert s["captures"] == 2
    (reason,) = s["fallbacks"]  # one reason for the three shapes over the limit: no count, no sizes in it
    assert s["fallbacks"][reason] == 3 and "GPUAUTOGRAD_RECAPTURE_LIMIT=2" in reason and "raise" in reason
    assert [r.getMessage() for r in caplog.records if r.name == "gpuautograd"] == [
        f"gpuautograd falls back to eager torch.autograd: {reason}"
    ]


def test_backend_names_are_checked(monkeypatch):
    x = rand(3)
    with pytest.raises(ValueError, match="unknown gpuautograd backend"):
        gpuautograd.backward(x.sum(), backend="nope")
    monkeypatch.setenv("GPUAUTOGRAD_BACKEND", "nope")
    with pytest.raises(ValueError, match="GPUAUTOGRAD_BACKEND"):
        gpuautograd.backward(x.sum())


def test_a_backend_that_cant_run_on_the_roots_device_is_refused_where_plans_are_cached():
    """The short path picks the backend resolved for the root's device; one that can't run there
    (cudagraph on CPU tensors) still raises the general path's error, hit or not."""
    for _ in range(2):
        x = rand(3)
        gpuautograd.backward(x.exp().sum(), backend="interpret-replay")
        assert_close(x.grad, x.detach().exp())
    assert gpuautograd.stats()["cache_hits"] == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            gpuautograd.backward(rand(3).exp().sum(), backend="cudagraph")


def test_the_backend_flag_is_read_on_every_hit(monkeypatch):
    """The short path reads GPUAUTOGRAD_BACKEND natively; a change to it, or a bad value, is seen
    on the next backward even where that graph's plan is cached under the old value."""
    from gpuautograd.runtime import engine

    monkeypatch.delenv("GPUAUTOGRAD_BACKEND", raising=False)

    def step():
        x = rand(3)
        gpuautograd.backward(x.exp().sum())
        assert_close(x.grad, x.detach().exp())

    step(), step()
    assert (gpuautograd.stats()["captures"], gpuautograd.stats()["cache_hits"]) == (1, 1)
    monkeypatch.setenv("GPUAUTOGRAD_BACKEND", "interpret-replay")
    step(), step()
    assert (gpuautograd.stats()["captures"], gpuautograd.stats()["cache_hits"]) == (2, 2)
    assert {key[0] for key in engine.CACHE.entries} == {"reference", "interpret-replay"}
    monkeypatch.setenv("GPUAUTOGRAD_BACKEND", "nope")
    with pytest.raises(ValueError, match="GPUAUTOGRAD_BACKEND"):
        step()


def test_a_hit_runs_no_rule(monkeypatch):
    from gpuautograd.rules import registry

    calls = []
    original = registry.RULES["TanhBackward0"]
    monkeypatch.setitem(registry.RULES, "TanhBackward0", lambda *a: calls.append(1) or original(*a))
    for _ in range(3):
        (x, w, b), h = graph()
        gpuautograd.backward(h.sum())
        assert x.grad is not None
    assert calls == [1]
    assert gpuautograd.stats()["cache_hits"] == 2


def test_cache_size_is_bounded(monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_SIZE", "2")
    x = rand(3)
    for fn in (torch.sin, torch.cos, torch.exp, torch.sin):
        gpuautograd.backward(fn(x).sum())
    s = gpuautograd.stats()
    assert s["cached_programs"] == 2
    assert s["captures"] == 4, "sin was evicted (least recently used) and had to be captured again"


def test_a_changing_python_loss_scale_does_not_recapture():
    for scale in (1024.0, 512.0, 2048.0):
        x = rand(4, 3)
        gpuautograd.backward((x.sin().sum() * scale) / 4.0)
        assert_close(x.grad, x.detach().cos() * scale / 4.0)
    assert gpuautograd.stats()["captures"] == 1

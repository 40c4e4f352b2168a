"""The draft catch-up (plugin/draft_catchup.py): the steps-0 draft extends deferred and done once per K steps
must leave the draft exactly where SGLang's extend-every-step leaves it: the same KV value in every slot of every
request's positions and the same draft outputs (first draft token, hidden state) for the next speculative step.
SGLang's own draft-extend code runs here on CPU (tests/plugin/draft_harness.py) on a toy draft whose outputs
depend on every KV value before them; the step cost and the acceptance are the GPU's to measure."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

from specctl.plugin.patches import catchup as dc
from specctl.plugin.engine import PluginSettings

pytestmark = pytest.mark.sglang  # torch and SGLang's sources come with the sglang environments
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def H(import_sibling):
    return import_sibling("draft_harness")


def tok(r, q):
    return (31 * r + 7 * q + q * q) % 89 + 1


def hid(r, q, width=3):
    return torch.tensor([r, q % 13, (r * q) % 5][:width], dtype=torch.float64)


def prefill(srv, reqs, lens):
    """The prefill's draft KV for the prompts (the same in both runs)."""
    for r, n in zip(reqs, lens):
        srv.draft.kv[srv.req_to_token[r, :n].long()] = torch.arange(n, dtype=torch.float64) * 11 + r


def step_of(srv, live):
    """One steps-0 step of the requests live = {req: committed length}: the batch and what verify returned."""
    reqs = sorted(live)
    lens = [live[r] for r in reqs]
    b = srv.batch(reqs, lens)
    res = srv.step_result([tok(r, live[r] + 1) for r in reqs], torch.stack([hid(r, live[r]) for r in reqs]))
    return b, res


class StandinGraph:
    """A runtime state's draft-extend CUDA graph runner as SGLang's _draft_extend_for_decode uses it: can_run_graph
    (the batch's width must be the captured one, its size within the captured sizes) and execute (here the toy
    draft's forward: a replay computes what the eager forward does, into static buffers; 0.5.23 hands it the rows
    to keep, selected in the graph before the LM head). `host`: a flashinfer draft's graph, whose replay plans from
    the batch's host lengths (0.5.17's fast_prefill_plan asserts seq_lens_cpu)."""

    def __init__(self, draft, width, max_bs=8, host=None):
        self.draft, self.captured_req_width, self.max_bs, self.host = draft, width, max_bs, host
        self.replays: list = []

    def can_run_graph(self, fb):
        return fb.spec_info.num_tokens_per_req == self.captured_req_width and fb.seq_lens.numel() <= self.max_bs

    def execute(self, fb, select_index=None):
        if self.host is not None:
            self.host(fb)
        self.replays.append([int(e) for e in fb.extend_seq_lens])
        out = self.draft.forward(fb).logits_output
        if select_index is None:
            return out
        return SimpleNamespace(next_token_logits=out.next_token_logits[select_index],
                               hidden_states=out.hidden_states[select_index])


BACKENDS = ("triton", "flashinfer")


def run(H, schedule, k=None, graph_bs=None, backend="triton", host_plan=None, attn=None):
    """schedule: list of (event, arg): ("prefill", {req: prompt len}) or ("off", None) (one steps-0 step of the
    live requests) or ("finish", req). Extends per step as SGLang does (k None) or through the catch-up (with a
    stand-in draft-extend graph k wide holding graph_bs requests, if given), on a draft whose attention is
    `backend`'s (the catch-up told that it plans from host lengths where it is flashinfer, unless `host_plan` says
    otherwise; `attn(server)`: another draft attention); then the next speculative step's draft inputs. Returns (KV,
    draft inputs of the next step, live lengths, catch-up)."""
    srv = H.Server(backend=backend)
    if attn is not None:
        srv.draft.attn_backend = attn(srv)
    host = backend == "flashinfer"
    graph = StandinGraph(srv.draft, k, graph_bs, host=H.check_host_lengths if host else None) if graph_bs else None
    cu = (dc.DraftCatchup(k=k, worker=srv.worker, torch_mod=torch, graph=graph,
                          host_plan=host if host_plan is None else host_plan) if k else None)
    live: dict = {}
    last = {}
    for ev, arg in schedule:
        if ev == "prefill":
            prefill(srv, list(arg), list(arg.values()))
            live.update(arg)
            if cu is not None:
                cu.after_prefill(srv.batch(sorted(arg), [arg[r] for r in sorted(arg)], H.ForwardMode.DRAFT_EXTEND_V2))
            for r in arg:  # the prefill's own draft outputs for the new request
                last[r] = (torch.tensor([[0.5]]), torch.tensor([[100 + r]]), torch.full((1, 3), float(r)))
        elif ev == "finish":
            live.pop(arg)
        else:
            b, res = step_of(srv, live)
            if cu is None:
                srv.dw.speculative_num_draft_tokens = 1
                srv.extend(srv.dw, b, res)
            else:
                assert cu.around_extend(srv.extend, srv.dw, b, res, (), {}) is None
            nd = res.next_draft_input
            for i, r in enumerate(sorted(live)):
                last[r] = (nd.topk_p[i:i + 1], nd.topk_index[i:i + 1], nd.hidden_states[i:i + 1])
            for r in live:
                live[r] += 1
    # the next step speculates: the draft reads the inputs the FutureMap holds for each request
    reqs = sorted(live)
    spec = srv.batch(reqs, [live[r] for r in reqs], H.ForwardMode.DECODE)
    spec.spec_info = SimpleNamespace(topk_p=torch.cat([last[r][0] for r in reqs]).float(),
                                     topk_index=torch.cat([last[r][1] for r in reqs]).long(),
                                     hidden_states=torch.cat([last[r][2] for r in reqs]).double())
    if cu is not None:
        srv.dw.speculative_num_steps = 3
        cu.before_draft(srv.dw, spec)
    return srv.draft.kv.clone(), spec.spec_info, live, cu


def assert_same_draft(ref, got, live):
    kv_ref, info_ref, _, _ = ref
    kv, info, _, _ = got
    assert torch.equal(kv[1:], kv_ref[1:])  # every real slot; slot 0 is SGLang's padding slot
    assert torch.equal(info.topk_index, info_ref.topk_index)
    assert torch.equal(info.hidden_states, info_ref.hidden_states)
    assert torch.equal(info.topk_p, info_ref.topk_p)


OFF = ("off", None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_off,k", [(21, 8), (8, 8), (3, 8), (1, 2), (40, 16)])
def test_the_catch_up_leaves_the_draft_where_extending_every_step_does(H, n_off, k, backend):
    sched = [("prefill", {1: 5, 2: 9})] + [OFF] * n_off
    ref, got = run(H, sched, backend=backend), run(H, sched, k=k, backend=backend)
    assert_same_draft(ref, got, got[2])
    cu = got[3]
    assert cu.on and cu.num_recorded == n_off
    # a catch-up every k steps-0 steps, and one before the draft unless the last step was one
    assert cu.num_catchups == n_off // k + (1 if n_off % k else 0)
    windows = got[3].worker._draft_worker.draft_runner.calls
    assert all(w == [k, k] for w in windows) and len(windows) == cu.num_catchups


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("graph_bs,replayed", [(8, True), (1, False)])
def test_a_catch_up_with_a_graph_of_its_width_replays_it_where_the_batch_fits(H, graph_bs, replayed, backend):
    """SGLang's own extend takes the graph when can_run_graph says so (two requests: within 8, not within 1) and
    the eager forward otherwise; either way the draft ends where extending every step leaves it."""
    sched = [("prefill", {1: 5, 2: 9})] + [OFF] * 10
    ref, got = run(H, sched, backend=backend), run(H, sched, k=4, graph_bs=graph_bs, backend=backend)
    assert_same_draft(ref, got, got[2])
    cu = got[3]
    assert cu.num_catchups == 3  # steps 4 and 8, and before the draft (2 pending)
    replays = cu.graph.replays
    assert replays == ([[4, 4]] * 3 if replayed else [])
    assert len(cu.worker._draft_worker.draft_runner.calls) == 3  # the toy forward ran every catch-up, either way
    assert cu.worker._draft_worker.cuda_graph_runner_for_draft_extend is None  # the steps-0 state's own, restored


def _states(*widths):
    """An adaptive controller's runtime states {steps: state}, each with a draft-extend runner of the given width
    (None: no graph) and speculative_num_draft_tokens = steps + 1."""
    return {steps: SimpleNamespace(speculative_num_draft_tokens=steps + 1,
                                   cuda_graph_runner_for_draft_extend=None if w is None
                                   else SimpleNamespace(captured_req_width=w, name=f"s{steps}"))
            for steps, w in widths}


@pytest.mark.parametrize("states,k,want", [
    (_states((0, 1), (1, 2), (3, 4)), 4, "s3"),
    (_states((0, 1), (1, 2), (3, 4)), 2, "s1"),
    (_states((0, 1), (1, 2), (3, 4)), 16, None),
    (_states((0, 1), (3, None)), 4, None),  # s3 built without a draft-extend graph
    (_states((0, 4), (3, 1)), 4, None),  # a runner captured at another width than its state's
])
def test_the_graph_of_width_k_is_a_built_states_draft_extend_runner(states, k, want):
    w = SimpleNamespace(adaptive_controller=SimpleNamespace(_states=states))
    got = dc.graph_of_width(w, k)
    assert (got is None) if want is None else (got.name == want)


def test_without_an_adaptive_controller_there_is_no_graph():
    assert dc.graph_of_width(SimpleNamespace(), 4) is None
    assert dc.graph_of_width(SimpleNamespace(adaptive_controller=SimpleNamespace()), 4) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_joining_mid_stretch_catch_up_over_their_own_pending_tokens(H, backend):
    sched = ([("prefill", {1: 5, 2: 9})] + [OFF] * 6 + [("prefill", {3: 4})] + [OFF] * 12 + [("prefill", {4: 30})]
             + [OFF] * 2)
    ref, got = run(H, sched, backend=backend), run(H, sched, k=8, backend=backend)
    assert_same_draft(ref, got, got[2])
    assert got[3].worker._draft_worker.draft_runner.calls == [[8, 8, 8], [8, 8, 8], [8, 8, 8, 8]]
    if backend == "flashinfer":  # each window planned from where it starts: the length after the step less what is
        # pending (catch-ups at steps 8 and 16, 8 pending; request 3 joined at step 7 with 4 tokens, 2 pending at step
        # 8; before the draft after step 20, 4 pending, request 4 prefilled with 30 tokens after step 18, 2 pending)
        assert got[3].worker._draft_worker.draft_runner.attn_backend.plans == [
            [13 - 8, 17 - 8, 6 - 2], [21 - 8, 25 - 8, 14 - 8], [25 - 4, 29 - 4, 18 - 4, 32 - 2]]


class SGLangFlashinferPlan:
    """The draft's attention as SGLang 0.5.17's own FlashInferAttnBackend.init_forward_metadata plans an extend
    (tests/plugin/fi_extend_harness.py: compiled from the installed source, flashinfer's plan() stood in for on CPU),
    over the draft harness's request slots; every plan's wrapper state is kept with the batch it came from."""

    def __init__(self, fx, req_to_token, use_paged, check_host_lengths):
        self.check_host_lengths = check_host_lengths
        self.h = fx.Harness(num_pool=req_to_token.shape[0], max_context_len=req_to_token.shape[1])
        self.h.updater.req_to_token = req_to_token
        self.h.backend.use_paged = use_paged
        self.plans: list = []

    def init_forward_metadata(self, fb):
        self.check_host_lengths(fb)
        # what flashinfer reads of the host lengths (DRAFT_EXTEND_V2 takes the backend's extend branch)
        fb2 = self.h.batch(fb.seq_lens.tolist(), fb.extend_prefix_lens.tolist(), slots=fb.req_pool_indices.tolist(),
                           host_seq_lens=fb.seq_lens_cpu.tolist(), host_prefix_lens=fb.extend_prefix_lens_cpu)
        self.plans.append((fb2, self.h.plan(fb2)))


@pytest.mark.parametrize("use_paged", [False, True])
def test_sglangs_flashinfer_extend_plan_takes_the_catch_ups_window(H, import_sibling, use_paged):
    """SGLang 0.5.17's flashinfer extend plan, given the catch-up's windows (eager ones: 16 rows a request), plans
    exactly them: k query rows a request; KV = each request's cached slots before its window (ragged: the window's
    own rows attend in the ragged part) or through its window's end (paged); and the draft ends where extending
    every step leaves it."""
    import sglang

    if sglang.__version__ != "0.5.17":
        pytest.skip("the harness compiles SGLang 0.5.17's extend plan path (0.5.23 plans through KVLocPlan)")
    fx = import_sibling("fi_extend_harness")
    k = 16
    sched = [("prefill", {1: 5, 2: 9})] + [OFF] * 5 + [("prefill", {4: 30})] + [OFF] * 18
    ref = run(H, sched, backend="flashinfer")
    plans: list = []

    def sglang_plan(srv):
        p = SGLangFlashinferPlan(fx, srv.req_to_token, use_paged, H.check_host_lengths)
        plans.append(p)
        return p
    got = run(H, sched, k=k, backend="flashinfer", attn=sglang_plan)
    assert_same_draft(ref, got, got[2])
    assert got[3].on and got[3].num_catchups == 2  # at step 16, and before the draft (2 pending)
    r2t = plans[0].h.updater.req_to_token
    # committed after step 16 (request 4: 30 tokens, then steps 6-16) less 16 / 16 / 11 pending; then, before the
    # draft, after step 18 less 2 pending
    for (fb, plan), starts in zip(plans[0].plans, ([5, 9, 30], [21, 25, 41])):
        rows = fb.req_pool_indices.tolist()
        assert fb.extend_prefix_lens_cpu == starts and plan["use_ragged"] is (not use_paged)
        window = [k * i for i in range(len(rows) + 1)]
        if use_paged:
            w = plan["paged"]
            assert w["_qo_indptr_buf"].tolist() == window
            kv = [s + k for s in starts]
        else:
            assert plan["ragged"]["_qo_indptr_buf"].tolist() == plan["ragged"]["_kv_indptr_buf"].tolist() == window
            w = plan["paged"]
            kv = starts
        assert w["_paged_kv_indptr_buf"].tolist() == [sum(kv[:i]) for i in range(len(kv) + 1)]
        want = torch.cat([r2t[r, :n] for r, n in zip(rows, kv)])
        assert torch.equal(w["_paged_kv_indices_buf"], want.to(w["_paged_kv_indices_buf"].dtype))


def test_a_flashinfer_draft_gets_no_window_it_cannot_plan(H):
    """Without the host lengths (the window planned on the GPU, as for triton) flashinfer's plan has nothing to read:
    the first catch-up fails, the catch-up turns itself off, and that step extends the draft as SGLang does."""
    sched = [("prefill", {1: 5, 2: 9})] + [OFF] * 6
    ref, got = run(H, sched, backend="flashinfer"), run(H, sched, k=4, backend="flashinfer", host_plan=False)
    cu = got[3]
    assert not cu.on and "plans a draft extend from seq_lens_cpu" in cu.off_reason
    assert not torch.equal(got[0][1:], ref[0][1:])  # steps 1-3 never reached the draft: fewer accepted, no wrong token


def test_a_flashinfer_batch_without_host_lengths_reads_them_from_the_gpu(H):
    """A step whose batch has no host lengths (SGLang resolves them for every step of a flashinfer launch; a batch
    without them would be another launch's) still gets a plannable window: its lengths read from the GPU, counted."""
    srv = H.Server(backend="flashinfer")
    ref = H.Server(backend="flashinfer")
    cu = dc.DraftCatchup(k=2, worker=srv.worker, torch_mod=torch, host_plan=True)
    for s in (srv, ref):
        prefill(s, [1, 2], [5, 9])
    live = {1: 5, 2: 9}
    for _ in range(4):
        b, res = step_of(srv, live)
        b.seq_lens_cpu = b.seq_lens_sum = None
        cu.around_extend(srv.extend, srv.dw, b, res, (), {})
        b2, res2 = step_of(ref, live)
        ref.dw.speculative_num_draft_tokens = 1
        ref.extend(ref.dw, b2, res2)
        live = {r: n + 1 for r, n in live.items()}
    assert cu.on and cu.num_catchups == 2 and cu.num_pulls == 2
    assert torch.equal(srv.draft.kv[1:], ref.draft.kv[1:])


def test_a_batch_without_host_rows_turns_the_catch_up_off_before_it_records(H):
    srv = H.Server()
    cu = dc.DraftCatchup(k=4, worker=srv.worker, torch_mod=torch)
    prefill(srv, [1], [5])
    b, res = step_of(srv, {1: 5})
    b.req_pool_indices_cpu = None
    cu.around_extend(srv.extend, srv.dw, b, res, (), {})
    assert not cu.on and "req_pool_indices_cpu" in cu.off_reason and cu.num_recorded == 0
    assert srv.draft.calls == [[1]]  # the step extended the draft as SGLang does


def test_a_request_that_finishes_mid_stretch_leaves_its_pending_positions_unextended(H):
    """The limit of deferring: request 1 finishes 4 steps after a catch-up, and its last 4 positions never get
    the draft's KV (a later request reusing that prefix from the radix cache would read the slots' old draft KV
    there: fewer accepted drafts for it, never a wrong token); every other slot is as SGLang leaves it."""
    sched = [("prefill", {1: 5, 2: 9})] + [OFF] * 12 + [("finish", 1)] + [OFF] * 3
    ref, got = run(H, sched), run(H, sched, k=8)
    srv_slots = H.Server().req_to_token
    tail = srv_slots[1, 5 + 8:5 + 12].long()  # steps 9-12 of request 1: positions 13-16
    keep = torch.ones_like(ref[0], dtype=torch.bool)
    keep[0] = False
    keep[tail] = False
    assert torch.equal(got[0][keep], ref[0][keep])
    assert not torch.equal(got[0][tail], ref[0][tail]) and not got[0][tail].any()
    assert torch.equal(got[1].topk_index, ref[1].topk_index) and torch.equal(got[1].hidden_states, ref[1].hidden_states)


def test_a_request_slot_taken_over_by_a_new_request_has_nothing_pending(H):
    """Request 1 leaves with tokens pending, and its slot's next request is prefilled: the catch-up must not
    extend the old request's positions into the new one's."""
    sched = [("prefill", {1: 5, 2: 9})] + [OFF] * 3 + [("finish", 1), ("prefill", {1: 20})] + [OFF] * 2
    ref, got = run(H, sched), run(H, sched, k=8)
    assert_same_draft(ref, got, got[2])


def test_requests_with_nothing_pending_keep_their_draft_inputs(H):
    srv = H.Server()
    cu = dc.DraftCatchup(k=4, worker=srv.worker, torch_mod=torch)
    prefill(srv, [1, 2], [5, 6])
    b, res = step_of(srv, {1: 5})  # only request 1 decodes a steps-0 step
    cu.around_extend(srv.extend, srv.dw, b, res, (), {})
    spec = srv.batch([1, 2], [6, 6], H.ForwardMode.DECODE)
    keep = SimpleNamespace(topk_p=torch.tensor([[0.0], [0.7]]), topk_index=torch.tensor([[0], [42]]),
                           hidden_states=torch.tensor([[0.0] * 3, [9.0, 8.0, 7.0]], dtype=torch.float64))
    spec.spec_info = SimpleNamespace(**vars(keep))
    srv.dw.speculative_num_steps = 1
    cu.before_draft(srv.dw, spec)
    assert spec.spec_info.topk_index[1].item() == 42 and spec.spec_info.topk_p[1].item() == pytest.approx(0.7)
    assert spec.spec_info.hidden_states[1].tolist() == [9.0, 8.0, 7.0]
    assert spec.spec_info.topk_index[0].item() != 0  # request 1's came from the catch-up
    assert cu.since == 0 and int(cu.pending[1]) == 0


def test_between_catch_ups_a_steps0_step_hands_on_sglangs_zero_stubs(H):
    srv = H.Server(width=3)
    cu = dc.DraftCatchup(k=4, worker=srv.worker, torch_mod=torch)
    prefill(srv, [1, 2], [5, 6])
    b, res = step_of(srv, {1: 5, 2: 6})
    cu.around_extend(srv.extend, srv.dw, b, res, (), {})
    nd = res.next_draft_input
    assert nd.topk_p.shape == (2, 1) and nd.topk_index.shape == (2, 1) and nd.hidden_states.shape == (2, 3)
    assert not nd.topk_p.any() and not nd.topk_index.any() and not nd.hidden_states.any()
    assert srv.draft.calls == [] and cu.pending[[1, 2]].tolist() == [1, 1] and cu.since == 1


def test_speculating_and_idle_steps_extend_as_sglang_does(H):
    srv = H.Server()
    cu = dc.DraftCatchup(k=4, worker=srv.worker, torch_mod=torch)
    prefill(srv, [1], [5])
    seen = []
    orig = lambda dw, batch, result, *a, **k: seen.append((batch, result))  # noqa: E731
    srv.dw.speculative_num_steps = 3
    b, res = step_of(srv, {1: 5})
    assert cu.around_extend(orig, srv.dw, b, res, (), {}) is None and len(seen) == 1
    srv.dw.speculative_num_steps = 0
    idle = srv.batch([1], [5], H.ForwardMode.IDLE)
    cu.around_extend(orig, srv.dw, idle, res, (), {})
    assert len(seen) == 2 and cu.num_recorded == 0 and cu.since == 0
    cu.before_draft(srv.dw, srv.batch([1], [5], H.ForwardMode.DECODE))  # nothing recorded: nothing to do
    assert cu.num_catchups == 0


def test_a_failing_catch_up_turns_it_off_and_the_step_extends_as_sglang_does(H, caplog):
    srv = H.Server()
    cu = dc.DraftCatchup(k=2, worker=srv.worker, torch_mod=torch)
    prefill(srv, [1], [5])
    b, res = step_of(srv, {1: 5})
    cu.around_extend(srv.extend, srv.dw, b, res, (), {})
    real = srv.draft.forward

    def forward(fb):  # the catch-up's window runs out of memory; a one-token extend does not
        if int(fb.extend_seq_lens[0]) > 1:
            raise RuntimeError("out of memory")
        return real(fb)

    srv.draft.forward = forward
    b, res = step_of(srv, {1: 6})
    seen = []

    def orig(dw, batch, result, *a, **k):
        seen.append((int(batch.seq_lens[0]), dw.speculative_num_draft_tokens))
        return srv.extend(dw, batch, result)

    with caplog.at_level(logging.ERROR, logger="specctl.plugin"):
        cu.around_extend(orig, srv.dw, b, res, (), {})
    # the catch-up (position 5's window of 2) failed; then SGLang's own extend of this step (position 6, width 1)
    assert not cu.on and "out of memory" in cu.off_reason and seen == [(5, 2), (6, 1)]
    assert res.next_draft_input.topk_index is not None  # this step's own draft outputs, from SGLang's extend
    assert sum("patch catchup off" in r.getMessage() for r in caplog.records) == 1
    cu.patch.turn_off("again")  # said once
    assert cu.off_reason.startswith("a steps-0 step failed")


def test_a_failing_catch_up_before_a_draft_leaves_the_draft_inputs_and_turns_it_off(H):
    srv = H.Server()
    cu = dc.DraftCatchup(k=8, worker=srv.worker, torch_mod=torch)
    prefill(srv, [1], [5])
    b, res = step_of(srv, {1: 5})
    cu.around_extend(srv.extend, srv.dw, b, res, (), {})
    spec = srv.batch([1], [6], H.ForwardMode.DECODE)
    spec.spec_info = SimpleNamespace(topk_p=torch.zeros(1, 1), topk_index=torch.zeros(1, 1, dtype=torch.int64),
                                     hidden_states=torch.zeros(1, 2, dtype=torch.float64))  # not the draft's width
    cu.before_draft(srv.dw, spec)
    assert not cu.on and "hidden_states" in cu.off_reason
    assert spec.spec_info.hidden_states.shape == (1, 2) and cu.since == 0


def test_the_ring_must_hold_two_steps():
    with pytest.raises(ValueError, match="at least 2"):
        dc.DraftCatchup(k=1, worker=SimpleNamespace(), torch_mod=torch)


def _backend(name):
    return type(name, (), {})()


def _worker(draft_backend="TritonAttnBackend", **sa):
    dw = SimpleNamespace(_draft_extend_for_decode=1, _draft_extend_for_prefill=1, draft=1, req_to_token_pool=1,
                         draft_runner=SimpleNamespace(attn_backend=_backend(draft_backend)))
    return SimpleNamespace(_draft_worker=dw, _stub_skipped_draft_extend=1, server_args=SimpleNamespace(**sa))


@pytest.mark.parametrize("kw,why", [
    ({}, None),
    ({"plain_reason": "a sliding-window model"}, "a sliding-window model"),
    ({"trees": True}, "tree states"),
    ({"skip_zero_extend": True}, "extends nothing"),  # SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND, read by the runtime
])
def test_unsupported_launches_are_named(kw, why):
    args = {"trees": False, "plain_reason": None, **kw}
    got = dc.unsupported_reason(_worker(), **args)
    assert (got is None) if why is None else (why in got)


def test_mixed_chunks_tensor_parallelism_and_missing_methods_are_named():
    assert "mixed chunked prefill" in dc.unsupported_reason(_worker(enable_mixed_chunk=True), trees=False,
                                                            plain_reason=None)
    assert "tensor parallelism" in dc.unsupported_reason(_worker(tp_size=2), trees=False, plain_reason=None)
    assert dc.unsupported_reason(_worker(tp_size=1), trees=False, plain_reason=None) is None
    w = _worker()
    del w._draft_worker.draft
    assert "no draft" in dc.unsupported_reason(w, trees=False, plain_reason=None)


@pytest.mark.parametrize("backend, ok", [("TritonAttnBackend", True), ("FlashInferAttnBackend", True),
                                         ("FlashAttentionBackend", False), ("NoneType", False)])
def test_a_triton_or_flashinfer_draft_only(backend, ok):
    """A triton draft plans the window on the GPU, a flashinfer one from the host lengths the catch-up gives it;
    another backend's draft-extend plan is unchecked, so the catch-up is refused up front there, not turned off
    by the first catch-up's error."""
    w = _worker(draft_backend=backend)
    if backend == "NoneType":
        w._draft_worker.draft_runner = SimpleNamespace()
    got = dc.unsupported_reason(w, trees=False, plain_reason=None)
    assert (got is None) if ok else (backend in got and "triton or flashinfer" in got)


@pytest.mark.parametrize("value,k", [(None, 0), ("off", 0), ("0", 0), ("on", 16), ("1", 16), ("8", 8)])
def test_the_setting_is_off_by_default_and_read_from_the_environment(value, k):
    env = {"SPECCTL_TELEMETRY": "none", "SPECCTL_POLICY": "none"}
    if value is not None:
        env["SPECCTL_PATCHES"] = f"catchup={value}"
    assert PluginSettings.from_env(env).draft_catchup == k


@pytest.mark.parametrize("value", ["maybe", "-3"])
def test_a_bad_setting_is_refused_with_its_name(value):
    with pytest.raises(ValueError, match="SPECCTL_PATCHES: catchup"):
        PluginSettings.from_env({"SPECCTL_PATCHES": f"catchup={value}"})


def test_build_says_why_not_and_builds_only_on_a_launch_that_can(H, caplog):
    srv = H.Server()
    srv.worker.server_args = SimpleNamespace()
    for name in ("_draft_extend_for_prefill", "draft"):
        setattr(srv.dw, name, lambda *a, **k: None)
    with caplog.at_level(logging.INFO, logger="specctl.plugin"):
        assert dc.build(srv.worker, k=8, trees=False, plain_reason="a sliding-window model") is None
        cu = dc.build(srv.worker, k=8, trees=False, plain_reason=None)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("patch catchup off" in m and "sliding-window" in m for m in msgs)
    assert isinstance(cu, dc.DraftCatchup) and cu.k == 8 and cu.pending.shape == (srv.req_to_token.shape[0],)
    assert cu.graph is None and any("draft catch-up on" in m and "eagerly" in m for m in msgs)
    srv.worker.adaptive_controller = SimpleNamespace(_states=_states((0, 1), (3, 4)))
    with caplog.at_level(logging.INFO, logger="specctl.plugin"):
        cu = dc.build(srv.worker, k=4, trees=False, plain_reason=None)
    assert cu.graph.name == "s3" and "replaying the draft-extend CUDA graph" in caplog.records[-1].getMessage()
    assert not cu.host_plan and "on the GPU (triton draft)" in caplog.records[-1].getMessage()
    fi = H.Server(backend="flashinfer")
    fi.worker.server_args = SimpleNamespace()
    for name in ("_draft_extend_for_prefill", "draft"):
        setattr(fi.dw, name, lambda *a, **k: None)
    with caplog.at_level(logging.INFO, logger="specctl.plugin"):
        cu = dc.build(fi.worker, k=4, trees=False, plain_reason=None)
    assert cu.host_plan and "from host lengths (flashinfer draft)" in caplog.records[-1].getMessage()


def test_the_runtime_builds_no_catch_up_when_its_hooks_are_missing(H, caplog):
    from specctl.plugin import sglang_hooks

    rt = sglang_hooks.PluginRuntime(PluginSettings(draft_catchup=8, telemetry_endpoint=None, policy_endpoint=None),
                                    patches=[dc.patch])
    with caplog.at_level(logging.ERROR, logger="specctl.plugin"):
        rt.build_catchup(H.Server().worker)  # checks the hooks first: none of them is registered in this process
    assert rt.catchup is None and any("patch catchup off" in r.getMessage() and "did not take effect" in r.getMessage()
                                      for r in caplog.records)


def test_install_registers_the_three_hooks_only_when_asked():
    import json
    import os
    import subprocess

    code = r"""
import json, sys
from sglang.srt.plugins.hook_registry import HookRegistry
from specctl.plugin import sglang_hooks
from specctl.plugin.engine import PluginSettings
s = PluginSettings.from_env({"SPECCTL_PATCHES": "catchup=" + sys.argv[1], "SPECCTL_TELEMETRY": "none",
                             "SPECCTL_POLICY": "none"})
sglang_hooks.install(s)
print(json.dumps({t: [f"{h.__module__}.{h.__name__}" for _, h, _ in hs] for t, hs in HookRegistry._hooks.items()}))
"""
    t = __import__("specctl.plugin.sglang_hooks", fromlist=["SGLANG_TARGETS"]).SGLANG_TARGETS
    ours = {t.extend_decode: f"{dc.__name__}.around_extend", t.draft: f"{dc.__name__}.before_draft",
            t.extend_prefill: f"{dc.__name__}.after_prefill",
            t.init_graphs: "specctl.plugin.patches.plain_decode.after_init_graphs"}
    for value, present in (("on", True), ("off", False)):
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        p = subprocess.run([sys.executable, "-c", code, value], capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        hooks = json.loads(p.stdout.strip().splitlines()[-1])
        for target, fn in ours.items():
            if target == t.init_graphs:
                assert fn in hooks[target]  # the decode state's (on by default) builds both
            else:
                assert (fn in hooks.get(target, [])) is present, (value, target)


def test_the_hooks_dispatch_through_the_real_registry(H, standin_module, monkeypatch):
    """The real HookRegistry wraps a stand-in draft worker whose methods are SGLang's own draft extend: steps-0
    extends go to the ring, the draft of the next speculative step finds the catch-up's inputs, and the draft's
    KV is where extending every step leaves it."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from specctl.plugin import runtime as plugin_runtime

    mod = standin_module("specctl_catchup_standin")
    extend = H.sglang().extend

    class StandinDraftWorker:
        def _draft_extend_for_decode(self, batch, batch_result, **kw):
            return extend(self, batch, batch_result, **kw)

        def _draft_extend_for_prefill(self, batch, target_hidden_states, next_token_ids, mm_input_embeds=None):
            return None

        def draft(self, batch):
            return SimpleNamespace(**vars(batch.spec_info))

    mod.StandinDraftWorker = StandinDraftWorker
    patch = dc.Patch(dc.NAME)
    names = {"_draft_extend_for_decode": (dc.around_extend, "AROUND"), "draft": (dc.before_draft, "BEFORE"),
             "_draft_extend_for_prefill": (dc.after_prefill, "AFTER")}
    for meth, (fn, kind) in names.items():  # guarded, as install() registers them
        HookRegistry.register(f"{mod.__name__}.StandinDraftWorker.{meth}", patch.wrapped(kind, fn),
                              getattr(HookType, kind))
    HookRegistry.apply_hooks()
    srv, ref = H.Server(), H.Server()
    dw = StandinDraftWorker()
    dw.__dict__.update({k: v for k, v in vars(srv.dw).items() if not k.startswith("_draft_extend")})
    srv.worker._draft_worker = dw
    cu = dc.DraftCatchup(k=4, worker=srv.worker, torch_mod=torch, patch=patch)
    monkeypatch.setattr(plugin_runtime, "_RUNTIME", SimpleNamespace(catchup=cu))
    for s in (srv, ref):
        prefill(s, [1, 2], [5, 7])
    dw._draft_extend_for_prefill(srv.batch([1, 2], [5, 7], H.ForwardMode.DRAFT_EXTEND_V2), None, None)
    live = {1: 5, 2: 7}
    for _ in range(6):
        b, res = step_of(srv, live)
        assert dw._draft_extend_for_decode(b, res) is None
        b2, res2 = step_of(ref, live)
        ref.dw.speculative_num_draft_tokens = 1
        extend(ref.dw, b2, res2)
        live = {r: n + 1 for r, n in live.items()}
    assert cu.num_recorded == 6 and cu.num_catchups == 1 and cu.since == 2
    dw.speculative_num_steps = 2
    spec = srv.batch([1, 2], [live[1], live[2]], H.ForwardMode.DECODE)
    spec.spec_info = SimpleNamespace(topk_p=torch.zeros(2, 1), topk_index=torch.zeros(2, 1, dtype=torch.int64),
                                     hidden_states=torch.zeros(2, 3, dtype=torch.float64))
    drafted = dw.draft(spec)
    assert cu.num_catchups == 2 and cu.since == 0
    assert torch.equal(srv.draft.kv[1:], ref.draft.kv[1:])
    assert torch.equal(drafted.hidden_states, res2.next_draft_input.hidden_states)
    assert torch.equal(drafted.topk_index, res2.next_draft_input.topk_index)

"""Pure helpers of the GPU runner (stdlib and specctl's vocabulary only; tested on CPU in tests/gpu/)."""
import bisect
import json
import math
import os
import re
import statistics as st
from importlib.util import find_spec

if find_spec("specctl") is None:  # the GPU machine: nothing installed, the repository as a PYTHONPATH folder
    import specctl_side

    specctl_side.make_site(os.environ.get("SPECCTL_SITE", "/tmp/specctl_site"))
from specctl.policies.table import OFF, config_name  # the one vocabulary of configurations

R_RUN = re.compile(r"#running-req: (\d+)")
R_TOK = re.compile(r"#(?:full )?token: (\d+)")  # KV tokens in use: the running requests' context
R_ACC = re.compile(r"accept len: ([\d.]+)")
R_TP = re.compile(r"gen throughput \(token/s\): ([\d.]+)")

# SGLang 0.5.17's built-in default adaptive config has candidates {0, 1, 3, 7}; the logits-buffer bug needs
# the launch steps to be the largest candidate.
SGLANG_ADAPTIVE_MAX_STEPS = 7


SKIP_DE = "+skipde"  # policy suffix: SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1 (0.5.17: steps 0 skips the draft's extend)
VERIFY_OFF = "+verify"  # plugin policy suffix: plain_decode=off (steps 0 is SGLang's trivial verify, not the decode state)
DE_GRAPHS = "+deg"  # plugin policy suffix: draft_graphs=on (each chain state's draft extend in its own graph; the default)
NO_DE_GRAPHS = "+nodeg"  # plugin policy suffix: draft_graphs=off (0.5.17's launch-width graphs: the control)
SPLITKV = "+splitkv"  # plugin policy suffix: splitkv=on (SGLang's split-KV verify kernel for topk-1 chains; the default)
STOCK_VERIFY = "+stockverify"  # plugin policy suffix: splitkv=off (SGLang's extend kernel: the control)
LOGPROBS = "+lp"  # plugin policy suffix: plain_logprobs=on (logprob steps in the decode state too)
FLASHINFER = "+fi"  # plugin policy suffix: plain_flashinfer=on (the decode state on flashinfer too; the default)
NO_FLASHINFER = "+nofi"  # plugin policy suffix: plain_flashinfer=off (flashinfer's trivial verify: the control)
FA3_PLAIN = "+fa3plain"  # plugin policy suffix: plain_fa3=on (the decode state on fa3; off: SGLang's steps-0 there)
FI_HOST_PLAN = "+fihost"  # plugin policy suffix: fi_plan=check (flashinfer's verify plan from host values, compared
#                           with plan()'s for its first 32 plans; a mismatch logs and turns it off)
FI_EXTEND = "+fiext"  # plugin policy suffix: fi_extend=check (flashinfer's prefill plans, the target's and the draft's
#                      extend over it, with host indptrs: plan() makes no blocking reads; compared at first)
HOST_LENS = "+hostlens"  # plugin policy suffix: host_lens=check (a step after a decode-state step or a prefill takes its
#                         sequence lengths from the host, compared with the device pull at first; the default)
NO_HOST_LENS = "+nohostlens"  # plugin policy suffix: host_lens=off (SGLang's device pull every step: the control)
CATCHUP = "+catchup"  # plugin policy suffix: catchup=on (steps 0 extends the draft once per 16 steps-0 steps and before
#                       the next draft, not every step: plugin/patches/catchup.py)
CATCHUP4 = "+catchup4"  # plugin policy suffix: catchup=4 (a window of 4 steps: on an s3 launch it replays the s3
#                         state's draft-extend CUDA graph, 4 tokens wide, instead of an eager extend of 16 tokens a
#                         request whose logits are allocated each time: the prefill-cost A/B against +catchup)
SCALAR_ALLOC = "+scalaralloc"  # plugin policy suffix: spec_alloc=off (0.5.17's speculative KV allocation reads each
#                               request's length as a tensor scalar: the control of the plugin's default)
# a plugin policy's suffix -> (parse_policy's field, its value, the plugin's patch (SPECCTL_PATCHES), its setting,
# why a plugin)
PLUGIN_SWITCHES = {
    VERIFY_OFF: ("plain_decode", False, "plain_decode", "off", "it turns the plugin's decode state off"),
    DE_GRAPHS: ("draft_extend_graphs", True, "draft_graphs", "on", "the plugin sizes the draft-extend graphs"),
    NO_DE_GRAPHS: ("draft_extend_graphs", False, "draft_graphs", "off", "the plugin sizes the draft-extend graphs"),
    SPLITKV: ("splitkv_verify", True, "splitkv", "on", "the plugin turns the kernel on"),
    STOCK_VERIFY: ("splitkv_verify", False, "splitkv", "off", "the kernel switch is the plugin's"),
    LOGPROBS: ("plain_decode_logprobs", True, "plain_logprobs", "on", "it lets logprob steps into its decode state"),
    FLASHINFER: ("plain_decode_flashinfer", True, "plain_flashinfer", "on", "it builds its decode state on flashinfer"),
    FI_HOST_PLAN: ("fi_verify_host_plan", True, "fi_plan", "check", "it plans flashinfer's verify from host values"),
    FI_EXTEND: ("fi_extend_host_plan", True, "fi_extend", "check", "it plans flashinfer's prefills from host indptrs"),
    HOST_LENS: ("host_seq_lens", True, "host_lens", "check", "it keeps the decode state's sequence lengths on the host"),
    FA3_PLAIN: ("plain_decode_fa3", True, "plain_fa3", "on", "it builds its decode state on fa3"),
    NO_FLASHINFER: ("plain_decode_flashinfer", False, "plain_flashinfer", "off",
                    "it builds its decode state on flashinfer unless told not to"),
    NO_HOST_LENS: ("host_seq_lens", False, "host_lens", "off",
                   "it keeps the decode state's sequence lengths on the host unless told not to"),
    CATCHUP: ("draft_catchup", True, "catchup", "on", "it defers the steps-0 draft extends"),
    CATCHUP4: ("draft_catchup", 4, "catchup", "4", "it defers the steps-0 draft extends"),
    SCALAR_ALLOC: ("spec_alloc_list", False, "spec_alloc", "off",
                   "the plugin hands SGLang's speculative KV allocation its lengths as a list"),
}


def env_patches(env):
    """SPECCTL_PATCHES of a server's environment as {patch: setting} (empty: every patch at its default)."""
    items = [x.split("=", 1) for x in env.get("SPECCTL_PATCHES", "").split(",") if x]
    return {k: v for k, v in items}


# any policy's suffix -> the SGLang flags it adds to that server (the identity probe's controls: is a parting
# the CUDA graphs', the overlap scheduler's, or the forward's)
SERVER_FLAGS = {
    "+nooverlap": ("--disable-overlap-schedule",),
    "+eager": ("--disable-cuda-graph",),
}


# any policy's suffix -> what the harness does to that server once it is warm: +freezegc posts SGLang's /freeze_gc
# (gc.freeze() in the scheduler and the detokenizer, as SGLang's own long-collection warning advises): with
# --log-gc, whether the collections inside the measured windows are what a server's extra host time is
SERVER_ACTIONS = {"+freezegc": "freeze_gc"}
R_GC_FROZEN = re.compile(r"Freezing GC in Scheduler process\. gen0: (\d+)->(\d+), gen1: (\d+)->(\d+), gen2: (\d+)->(\d+)")


def gc_frozen(text):
    """SGLang's log line of /freeze_gc in the scheduler -> the objects each generation held before the freeze
    (what a full collection walks from then on is what was allocated after it), or None without the line."""
    m = R_GC_FROZEN.search(text)
    return None if m is None else {"gen0": int(m.group(1)), "gen1": int(m.group(3)), "gen2": int(m.group(5))}


def parse_policy(pol):
    """'off' | 'static:C' | 'threshold:T:C' | 'plugin-fixed:T:C' | 'sglang-adaptive' | 'specctl' | 'specctl:TREE'
    -> dict; C is a configuration: sN (chain), tree (the seed operator's s2k4n16) or sNkKnD.
    threshold:T:<tree> runs as plugin-fixed (SGLang's adaptive mode refuses topk != 1); specctl:<tree> is the
    plugin online with the runtime states off, its launch chain s1 and the tree.
    plugin-fixed:T:sN is threshold:T:sN decided by the specctl plugin in fixed mode (telemetry to a
    daemon): the same server with and without the plugin, for the overhead figure; plugin-fixed:1:sN is
    plain decode inside the EAGLE-3 server at every batch size (the steps-0 state's cost).
    Any speculative policy may end in +skipde: the server runs with SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1
    (its steps-0 state no longer extends the draft; an upshift then drafts from stale state); a plugin policy
    in +verify, +deg / +nodeg, +splitkv / +stockverify, +lp, +fi / +nofi, +fihost, +hostlens / +nohostlens,
    +catchup / +catchup4, +scalaralloc, in any order: each one patch's setting in SPECCTL_PATCHES (PLUGIN_SWITCHES). Any policy may end in +nooverlap (--disable-overlap-schedule) and +eager
    (--disable-cuda-graph): SERVER_FLAGS; and in +freezegc (SERVER_ACTIONS: SGLang's /freeze_gc once it is warm)."""
    if "@" in pol:  # a run of a pinned server: the server's policy, then the configuration in force
        return pinned_run(pol)
    base, suffixes = pol, set()
    known = (SKIP_DE, *PLUGIN_SWITCHES, *SERVER_FLAGS, *SERVER_ACTIONS)
    for suffix in known * len(known):
        if base.endswith(suffix):
            base, _ = base[:-len(suffix)], suffixes.add(suffix)
    p = _parse_policy(base)
    if SKIP_DE in suffixes:
        if p["kind"] == "off" or p["kind"] == "static":
            raise ValueError(f"{pol!r}: {SKIP_DE} needs an adaptive server (it acts on the steps-0 state)")
        p["skip_zero_draft_extend"] = True
    for suffix, (field_, value, _, _, why) in PLUGIN_SWITCHES.items():
        if suffix in suffixes:
            if p["kind"] not in ("specctl", "plugin-fixed", "pinned"):
                raise ValueError(f"{pol!r}: {suffix} needs a plugin policy ({why})")
            if p.get(field_, value) is not value:
                raise ValueError(f"{pol!r}: two suffixes set the plugin's {field_} both ways")
            p[field_] = value
    flags = [f for suffix, fl in SERVER_FLAGS.items() if suffix in suffixes for f in fl]
    if flags:
        p["server_flags"] = flags
    for suffix, action in SERVER_ACTIONS.items():
        if suffix in suffixes:
            p[action] = True
    return p


TREE = (2, 4, 16)  # the seed operator's EAGLE-3 tree: --speculative-eagle-topk 4 --speculative-num-steps 2 --speculative-num-draft-tokens 16
R_TREE = re.compile(r"s(\d+)k(\d+)n(\d+)$")


def parse_config(tok):
    """'sN' (chain) | 'tree' (TREE) | 'sNkKnD' -> (steps, topk, draft_tokens)."""
    if tok == "tree":
        return TREE
    m = R_TREE.match(tok)
    if m:
        return tuple(int(x) for x in m.groups())
    if re.fullmatch(r"s\d+", tok):
        return (int(tok[1:]), 1, int(tok[1:]) + 1)
    raise ValueError(f"unknown configuration {tok!r} (sN, tree or sNkKnD)")


def file_tag(pol):
    """A policy or run name as it appears in a call's file names: specctl-<tag>/, <variant>-<tag>.log, ...
    (pinned:s1/s2/s3 -> pinned_s1-s2-s3, pinned:s1/s3@s1 -> pinned_s1-s3-at-s1)."""
    return pol.replace(":", "_").replace("/", "-").replace("@", "-at-")


PIN_ALL = 1_000_000  # a pinned run's threshold: its configuration below it, i.e. at every batch size


def pinned_run(pol):
    """'pinned:C1/C2/...[+suffixes]@PIN' -> the run's policy dict: a pinned server (one plugin server, online, with
    the decode state and a runtime state per Ci; run_bench publishes one table at a time, no daemon) measured
    while the table ran PIN ('off' or one of the Ci) at every batch size. It decides as plugin-fixed:1:C1 (PIN off)
    or plugin-fixed:PIN_ALL:PIN would, so it is read as that (cost profiles: path_config), plus `pinned` (the
    server's policy) and `pin`."""
    server, _, pin = pol.rpartition("@")
    p = parse_policy(server)
    if p["kind"] != "pinned":
        raise ValueError(f"{pol!r}: only a pinned:... server's runs carry @CONFIG")
    if pin == "off":
        cfg, threshold = p["configs"][0], 1
    else:
        cfg, threshold = parse_config(pin), PIN_ALL
        if cfg not in p["configs"]:
            raise ValueError(f"{pol!r}: {pin} is not among the server's configurations")
    return dict(p, kind="plugin-fixed", threshold=threshold, steps=cfg[0], config=cfg, pinned=server, pin=pin)


def pinned_fallback_config(p):
    """The configuration of a pinned server's fallback (SPECCTL_FALLBACK 1:C: plain decode at every batch size; C
    only names a built state): its first chain, else its first configuration."""
    return next((c for c in p["configs"] if c[1] == 1), p["configs"][0])


def pin_names(p):
    """The configurations a pinned server's runs go through, in order: the decode state first."""
    return ["off", *(config_name(c) for c in p["configs"])]


def pin_rows(pin):
    """The table a pinned server publishes for PIN: one row from batch 1 (specctl_side.policy_obj rows)."""
    return [(1, None, OFF if pin == "off" else parse_config(pin))]


def _parse_policy(pol):
    if pol == "off":
        return {"kind": "off"}
    if pol in ("sglang-adaptive", "specctl"):
        return {"kind": pol}
    if pol == "specctl-noctx":  # specctl with its daemon on --no-ctx-axis: one table for any context
        return {"kind": "specctl", "ctx_axis": False}
    parts = pol.split(":")
    if parts[0] == "pinned" and len(parts) == 2:
        configs = [parse_config(x) for x in parts[1].split("/") if x]
        if not configs or any(c[0] == 0 for c in configs) or len(set(configs)) != len(configs):
            raise ValueError(f"{pol!r}: pinned:C1/C2/... names each speculative configuration once (the decode "
                             f"state comes with every pinned server)")
        from specctl.plugin.launch_args import candidate_problem
        why = candidate_problem([OFF, *configs])
        if why:
            raise ValueError(f"{pol!r}: {why}")
        return {"kind": "pinned", "configs": configs}
    if parts[0] == "specctl" and len(parts) == 2:  # specctl choosing among off, its launch chain and a tree
        c = parse_config(parts[1])
        if c[1] == 1:
            raise ValueError(f"{pol!r}: specctl:<tree> takes a tree; chains are the plain 'specctl' policy")
        return {"kind": "specctl", "config": c}
    if parts[0] == "static" and len(parts) == 2:
        c = parse_config(parts[1])
        return {"kind": "static", "steps": c[0], "config": c}
    if parts[0] in ("threshold", "plugin-fixed") and len(parts) == 3:
        c = parse_config(parts[2])
        p = {"kind": parts[0], "threshold": int(parts[1]), "steps": c[0], "config": c}
        if c[1] > 1 and p["kind"] == "threshold":
            # SGLang's adaptive mode refuses topk != 1 (it falls back to the static tree): the threshold is the
            # plugin's, in fixed mode, with the tree built as an extra runtime state
            p.update(kind="plugin-fixed", decided_by="specctl plugin, fixed mode (SGLang refuses adaptive trees)")
        if p["threshold"] < (1 if p["kind"] == "plugin-fixed" else 2):
            raise ValueError(f"{pol!r}: threshold too small (SGLang's slots need T >= 2; the plugin's T >= 1)")
        return p
    raise ValueError(f"unknown policy {pol!r}")


def daemon_configs(p):
    """`specctl serve --configs` for a plugin policy: exactly the runtime states its server builds."""
    c = p.get("config")
    if c is None or c[1] == 1:
        return None  # specctl_side.CONFIGS
    return ",".join(config_name(x) for x in tree_launch(p)[3])


def tree_launch(p):
    """(flags without the draft path, env, adaptive config, state configs) of a plugin policy with a tree, from
    specctl's own `specctl sglang-args` logic: launched as a topk-1 chain, the tree built as one more state."""
    from specctl.plugin import launch_args
    from specctl.plugin.engine import state_configs
    fixed = p["kind"] == "plugin-fixed"
    la = launch_args.build([(0, 1, 1), p["config"]], fallback_config=p["config"],
                           fallback_threshold=p["threshold"] if fixed else launch_args.DEFAULT_THRESHOLD,
                           mode="fixed" if fixed else "online")
    states = list(state_configs(la.adaptive_config["1"]["candidate_steps"],
                                launch_args.tree_states(la.adaptive_config)).values())
    return flags_without_config_path(la), la.env, la.adaptive_config, states


def flags_without_config_path(la):
    """specctl's launch flags less `--speculative-adaptive-config PATH` (run_bench writes the config and adds its own)."""
    i = la.flags.index("--speculative-adaptive-config")
    return la.flags[:i] + la.flags[i + 2:]


def eagle_args(draft, steps, topk=1, draft_tokens=None):
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft, "--speculative-eagle-topk", str(topk),
            "--speculative-num-steps", str(steps), "--speculative-num-draft-tokens", str(draft_tokens or steps + 1)]


def policy_launch_args(pol, draft, specctl_max_steps=3):
    """(extra server args, extra env, adaptive config dict or None) for a policy."""
    p = parse_policy(pol)
    args, env, cfg = _launch_args(p, draft, specctl_max_steps)
    if p.get("skip_zero_draft_extend"):
        env = dict(env, SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND="1")
    patches = dict(env_patches(env))
    for field_, value, patch, setting, _ in PLUGIN_SWITCHES.values():
        if p.get(field_) is value:
            patches[patch] = setting
    if patches:
        env = dict(env, SPECCTL_PATCHES=",".join(f"{k}={v}" for k, v in patches.items()))
    return args + list(p.get("server_flags", ())), env, cfg


def _launch_args(p, draft, specctl_max_steps):
    if p["kind"] == "off":
        return [], {}, None
    if p["kind"] == "static":
        return eagle_args(draft, *p["config"]), {}, None
    if p["kind"] == "pinned":  # specctl's own launch for its configurations, online, no daemon (run_bench pins)
        from specctl.plugin import launch_args
        la = launch_args.build([OFF, *p["configs"]], mode="online", fallback_threshold=1,
                               fallback_config=pinned_fallback_config(p))
        env = {k: v for k, v in la.env.items() if k not in ("SPECCTL_SERVER_ID", "SPECCTL_MODE")}  # run_bench's own
        return (flags_without_config_path(la) + ["--speculative-draft-model-path", draft],
                dict(env, SGLANG_PLUGINS="specctl"), la.adaptive_config)
    if p.get("config", (0, 1))[1] > 1:  # plugin-fixed:T:tree, specctl:tree
        flags, env, cfg, _ = tree_launch(p)
        return flags + ["--speculative-draft-model-path", draft], dict(env, SGLANG_PLUGINS="specctl"), cfg
    if p["kind"] in ("threshold", "plugin-fixed"):
        # spec with N steps below the threshold, steps 0 (1-token verify) from it up; launch at N (largest candidate)
        cfg = {"1": {"candidate_steps": [p["steps"]]}, str(p["threshold"]): {"candidate_steps": [0]}}
        if p["threshold"] == 1:  # plugin-fixed:1:sN, steps 0 everywhere: both states built for every batch size
            cfg = {"1": {"candidate_steps": [0, p["steps"]]}}
        env = {} if p["kind"] == "threshold" else {"SGLANG_PLUGINS": "specctl", "SPECCTL_MODE": "fixed",
                                                    "SPECCTL_FALLBACK": f"{p['threshold']}:s{p['steps']}"}
        return eagle_args(draft, p["steps"]) + ["--speculative-adaptive"], env, cfg
    if p["kind"] == "sglang-adaptive":
        return eagle_args(draft, SGLANG_ADAPTIVE_MAX_STEPS) + ["--speculative-adaptive"], {}, None
    if p["kind"] == "specctl":
        cfg = {"1": {"candidate_steps": list(range(0, specctl_max_steps + 1))}}
        return (eagle_args(draft, specctl_max_steps) + ["--speculative-adaptive"], {"SGLANG_PLUGINS": "specctl"}, cfg)
    raise AssertionError(p)


RESYNC_PROBES, RESYNC_FILLERS = 4, 60  # run_bench's draft-resync probe: 4 probes beside 60 fillers (batch 64)


def max_concurrency(levels, phase_concurrencies=(), identity_c=1, resync=False):
    """The most requests a run_bench server will hold at once: its --max-running-requests and its largest decode
    CUDA graph. Every part of the run counts (the levels, the phase workload, the identity probe, the resync
    probe): a cap below one of them serialises that part's requests, and its figures mean nothing (2026-12-01:
    a resync call without levels ran its probes one at a time)."""
    parts = [1, int(identity_c), *map(int, levels), *map(int, phase_concurrencies)]
    if resync:
        parts.append(RESYNC_PROBES + RESYNC_FILLERS)
    return max(parts)


def server_args(maxc, mem_fraction, *, max_total_tokens=0, prefill_graph=False, request_stats=False,
                attention_backend="triton", radix_cache=True):
    """The SGLang flags every testbed server shares (run_bench.py, specctl_e2e.py), so that their figures compare.
    max_total_tokens caps the KV pool (servers started together on one GPU then all fit); without prefill_graph
    the prefill CUDA graphs are not captured (~50 s less start-up per server; decode graphs stay); request_stats
    has every finished request log its time in the wait queue (`ReqTimeStats` lines: request_stats());
    attention_backend: every server's (triton, the testbed's, or flashinfer: issue 20 item 2); without radix_cache
    (--disable-radix-cache) every prefill is the whole prompt: the testbed's closed loops send its 244 prompts
    again and again, so with the cache most prefills are 1 new token per request in the no-spec server and 2 in
    an EAGLE-3 one (prefill_batches), prefills no traffic of new prompts has."""
    args = ["--attention-backend", attention_backend, "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--mm-feature-transport", "cpu", "--decode-log-interval", "10", "--max-running-requests", str(maxc),
            "--cuda-graph-max-bs-decode", str(maxc), "--mem-fraction-static", str(mem_fraction),
            "--chunked-prefill-size", "8192", "--sleep-on-idle", "--host", "127.0.0.1"]
    if max_total_tokens:
        args += ["--max-total-tokens", str(max_total_tokens)]
    if not prefill_graph:
        args.append("--disable-prefill-cuda-graph")
    if request_stats:
        args.append("--enable-request-time-stats-logging")
    if not radix_cache:
        args.append("--disable-radix-cache")
    return args


def weights_gb(*dirs):
    """The safetensors in these model directories, GB (what a server loads before its KV pool is sized)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d in dirs if d and os.path.isdir(d)
               for f in os.listdir(d) if f.endswith(".safetensors")) / 2 ** 30


def kv_gb(tokens, *dirs):
    """GB of bf16 KV cache that `tokens` tokens take in the models of these directories (each config.json's layers x
    KV heads x head dim x K and V x 2 bytes; a directory without a readable config counts nothing)."""
    total = 0
    for d in dirs:
        try:
            c = json.load(open(os.path.join(d, "config.json")))
            head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
            total += c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 2 * 2
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            continue
    return tokens * total / 2 ** 30


def parse_mem_fraction(text):
    """--mem-fraction: a float (every server's --mem-fraction-static; 0 = 0.8 / servers at once) or `fit:GB`
    (each server's fraction from the GPU memory free just before it starts: its weights plus GB)."""
    if text.startswith("fit:"):
        gb = float(text[4:])
        if gb <= 0:
            raise ValueError(f"--mem-fraction fit:GB needs GB > 0, not {text!r}")
        return ("fit", gb)
    f = float(text)
    if not 0 <= f < 1:
        raise ValueError(f"--mem-fraction must be in [0, 1) or fit:GB, not {text!r}")
    return ("fixed", f)


def fit_fraction(free_gb, load_gb, extra_gb, cap=0.95):
    """SGLang 0.5.17 sizes the KV pool as (free after loading) - (free before loading) x (1 - fraction), and refuses
    to start when that is not positive (kv_cache_configurator._profile_available_bytes): a server that loads
    load_gb into free_gb needs fraction > load_gb / free_gb; extra_gb more is its KV pool and headroom. Servers
    loading at once each see the others' loads as theirs, so a fitted fraction holds for one start at a time."""
    f = (load_gb + extra_gb) / free_gb if free_gb > 0 else float("inf")
    if f > cap:
        raise ValueError(f"{free_gb:.1f} GB free cannot hold {load_gb:.1f} GB of weights and {extra_gb:.1f} GB more "
                         f"(fraction {f:.2f} > {cap})")
    return math.ceil(f * 1000) / 1000  # rounded up: never below what the weights need


def gpu_free_gb(smi_out, visible=None):
    """GB free on the GPU this process sees, from `nvidia-smi --query-gpu=index,memory.free --format=csv,noheader,
    nounits` (MiB) and CUDA_VISIBLE_DEVICES (its first entry, an index; unset: GPU 0)."""
    rows = {}
    for line in smi_out.strip().splitlines():
        idx, mib = (x.strip() for x in line.split(","))
        rows[idx] = float(mib) / 1024
    want = (visible or "0").split(",")[0].strip()
    if want not in rows:
        raise ValueError(f"GPU {want!r} (CUDA_VISIBLE_DEVICES) is not in nvidia-smi's list {sorted(rows)}")
    return rows[want]


R_REQ_STATS = re.compile(r"ReqTimeStats\(rid=[^,]*, input_len=(\d+), cached_input_len=(\d+), output_len=(\d+).*?\): "
                         r"queue_duration=([\d.]+)ms, forward_duration=([\d.]+)ms, entry_time=([\d.]+)")


def spread_tokens(new, spread, k):
    """The k-th request's max_new_tokens: `new` when spread is 0, else new + an offset in [-spread, spread] that
    depends on k alone (every server of a call gets the same sequence). 2026-12-02: with one cap for every request,
    the requests one prefill admitted finish at the same step on a server that emits one token per step, and their
    clients' next requests share a prefill again ("lockstep cohorts"), which speculation (per-request accept lengths)
    dissolves: a spread of caps is the control that removes this artefact of the closed loop."""
    if spread <= 0:
        return new
    return max(1, new + (k * 2654435761) % (2 * spread + 1) - spread)


def request_stats(text, min_gap_ms=1.0, cap=None, finish_gap_ms=1.5):
    """SGLang's per-request `ReqTimeStats` lines (--enable-request-time-stats-logging) -> how long requests waited
    in the queue before their prefill (ms: median, p90, mean) and how their arrivals at the scheduler cluster:
    `arrival_groups`, the runs of entries less than min_gap_ms apart (a group can share one prefill), and
    requests per group. An entry is stamped when the scheduler's receive pass takes the request (once per loop
    iteration), so the groups are its prefill batches, and the queue time leaves out the wait in the socket.
    `finish_groups`: the runs of finish times (entry + queue + forward) less than finish_gap_ms apart, i.e. the
    decode steps where requests finished; with cap (the load's max_new_tokens) `lockstep`: of the pairs of requests
    that ran to the cap and were admitted in one receive pass, the share that finished in one step (`capped_frac`:
    how many ran to the cap). 2026-12-02: on a server emitting one token a step lockstep is ~1, the finishers of a
    step come back together and share a prefill; speculation's per-request accept lengths take it to ~0.02, and
    the server runs ~20 % more prefill iterations (docs/results.md). None without such lines."""
    rows = [(float(m.group(6)), float(m.group(4)), float(m.group(5)), int(m.group(1)), int(m.group(2)), int(m.group(3)))
            for m in R_REQ_STATS.finditer(text)]
    if not rows:
        return None
    q = sorted(r[1] for r in rows)
    entries = _runs([r[0] for r in rows], min_gap_ms / 1000.0)
    groups = len(entries)
    out = {"requests": len(rows), "queue_ms_median": round(q[len(q) // 2], 3),
           "queue_ms_p90": round(q[min(len(q) - 1, int(0.9 * len(q)))], 3), "queue_ms_mean": round(sum(q) / len(q), 3),
           "arrival_groups": groups, "requests_per_group": round(len(rows) / groups, 3),
           "cached_input_frac": round(sum(r[4] for r in rows) / max(1, sum(r[3] for r in rows)), 4)}
    # when each request finished: entry + queue + forward (one result-processing pass stamps a step's finishers
    # within finish_gap_ms); entry groups are the scheduler's receive passes, i.e. its prefill batches
    tol = finish_gap_ms / 1000.0
    done = lambda r: r[0] + (r[1] + r[2]) / 1000.0  # noqa: E731
    out["finish_groups"] = len(_runs([done(r) for r in rows], tol))
    out["arrival_per_finish_group"] = round(groups / out["finish_groups"], 3)
    if cap:
        # lockstep: of the pairs of cap-length requests admitted in one receive pass, the share that finished together
        first = [g[0] for g in entries]
        by_entry: dict = {}
        for r in rows:
            if r[5] >= cap:
                by_entry.setdefault(bisect.bisect_right(first, r[0]) - 1, []).append(done(r))
        pairs = lambda n: n * (n - 1) // 2  # noqa: E731
        total = sum(pairs(len(ts)) for ts in by_entry.values())
        same = sum(pairs(len(g)) for ts in by_entry.values() for g in _runs(ts, tol))
        out["lockstep"] = round(same / total, 3) if total else None
        out["capped_frac"] = round(sum(1 for r in rows if r[5] >= cap) / len(rows), 3)
    return out


R_GC_END = re.compile(r"GC end: Time [\d.]+ \| Generation (\d+) \| Duration: ([\d.]+)s")


def gc_summary(text, wall_s=None):
    """SGLang's GC log lines (SGLANG_LOG_GC=1: the scheduler logs every collection's start and end, its duration in
    0.1 ms) -> per generation the collections, their total and longest ms, and over all `ms` and, with wall_s (the
    window's length), `ms_per_s`: the share of the window the scheduler's thread spent collecting. None without such
    lines (a server launched without the variable, or a window with no collection)."""
    per: dict = {}
    for m in R_GC_END.finditer(text):
        g = per.setdefault(f"gen{m.group(1)}", {"n": 0, "ms": 0.0, "max_ms": 0.0})
        ms = float(m.group(2)) * 1000.0
        g["n"] += 1
        g["ms"] += ms
        g["max_ms"] = max(g["max_ms"], ms)
    if not per:
        return None
    for g in per.values():
        g["ms"], g["max_ms"] = round(g["ms"], 1), round(g["max_ms"], 1)
    out = {"ms": round(sum(g["ms"] for g in per.values()), 1), **dict(sorted(per.items()))}
    if wall_s:
        out["ms_per_s"] = round(out["ms"] / wall_s, 3)
    return out


def _runs(ts, gap_s):
    """Times -> the runs of them (sorted) whose neighbours are less than gap_s apart."""
    ts = sorted(ts)
    out = [[ts[0]]] if ts else []
    for a, b in zip(ts, ts[1:]):
        if b - a < gap_s:
            out[-1].append(b)
        else:
            out.append([b])
    return out


def parse_decode_lines(text, n=None):
    """Step times from SGLang 'Decode batch' lines: 1000 * #running-req * accept_len / gen_throughput (ms).
    The first line of a window spans an idle gap or prefill and is dropped; with n, only lines at exactly
    n running requests (steady state of a closed loop at concurrency n) count.
    A line's throughput is over the wall time since the previous Decode-batch line, prefill iterations
    included: `clean_step_ms_med` is the median over the lines with no `Prefill batch` line since the
    previous one (`clean_lines` of them), the decode step alone — at c >= 64 on the 8b testbed most windows
    hold a ~75 ms prefill, and a speculating server's more than the no-spec server's."""
    rows = []
    prefill = True  # the first window spans whatever came before
    for ln in text.splitlines():
        if "Prefill batch" in ln:
            prefill = True
            continue
        if "Decode batch" not in ln:
            continue
        a, b, c, t = R_RUN.search(ln), R_ACC.search(ln), R_TP.search(ln), R_TOK.search(ln)
        if not (a and c):
            continue
        rows.append((int(a.group(1)), float(b.group(1)) if b else 1.0, float(c.group(1)), int(t.group(1)) if t else None,
                     not prefill))
        prefill = False
    rows = rows[1:]
    sel = [r for r in rows if (n is None or r[0] == n) and r[2] > 0]
    if len(sel) >= 4:
        sel = sel[1:]
    steps = [1000.0 * r[0] * r[1] / r[2] for r in sel]
    if not steps:
        return {"n_lines": 0, "all_lines": len(rows)}
    mean = st.mean(steps)
    out = {"n_lines": len(steps), "step_ms_med": round(st.median(steps), 4), "step_ms_mean": round(mean, 4),
           "step_ms_cv": round(st.pstdev(steps) / mean, 4) if mean else None,
           "accept_len": round(st.mean(r[1] for r in sel), 3), "gen_tok_s_med": round(st.median(r[2] for r in sel), 1)}
    ctx = [r[3] / r[0] for r in sel if r[3] is not None and r[0] > 0]
    if ctx:  # mean context tokens per running request (#token / #running-req), the profile's context
        out["ctx_per_req_med"] = round(st.median(ctx), 1)
    clean = [1000.0 * r[0] * r[1] / r[2] for r in rows if r[4] and (n is None or r[0] == n) and r[2] > 0]
    out["clean_lines"] = len(clean)
    if clean:
        out["clean_step_ms_med"] = round(st.median(clean), 4)
        cm = st.mean(clean)
        out["clean_step_ms_cv"] = round(st.pstdev(clean) / cm, 4) if cm else None
    return out


R_PREFILL_NEW = re.compile(r"#new-seq: (\d+)")
R_PREFILL_TOKENS = re.compile(r"#new-token: (\d+), #cached-token: (\d+)")
R_PREFILL_GRAPH = re.compile(r"cuda graph: (True|False)")


def prefill_batches(text, min_running=90):
    """SGLang's `Prefill batch` lines at high load (#running-req >= min_running): how many, how many new
    requests each admits on average, the new (uncached) prompt tokens per admitted request, the share of the
    prompt tokens the radix cache held, and the share of those prefills that ran in SGLang's prefill CUDA graph
    (None where the lines do not say: a server launched without one). 2026-12-03 (c = 128): an EAGLE-3 server
    held at plain decode ran 317 prefill batches of 1.70 requests where the no-spec server ran 256 of 1.90.
    Why the last three: with the testbed's prompts cached, most no-spec prefills are 1 new token per request and
    EAGLE-3 ones 2 (their radix cache keys on token pairs), and SGLang 0.5.17 replays its prefill graph only where
    padding to the smallest captured size (4) at most doubles the tokens: the EAGLE-3 server's prefills ran in
    the graph, the no-spec server's mostly eager (2026-12-03, second lease, call M2)."""
    new, toks, cached, graph = [], 0, 0, []
    for ln in text.splitlines():
        if "Prefill batch" not in ln:
            continue
        a, b = R_RUN.search(ln), R_PREFILL_NEW.search(ln)
        if a and b and int(a.group(1)) >= min_running:
            new.append(int(b.group(1)))
            t, g = R_PREFILL_TOKENS.search(ln), R_PREFILL_GRAPH.search(ln)
            if t:
                toks, cached = toks + int(t.group(1)), cached + int(t.group(2))
            if g:
                graph.append(g.group(1) == "True")
    return {"min_running": min_running, "prefill_batches": len(new),
            "new_requests_per_batch": round(st.mean(new), 3) if new else None,
            "new_tokens_per_request": round(toks / sum(new), 2) if new and sum(new) else None,
            "cached_token_share": round(cached / (toks + cached), 4) if toks + cached else None,
            "cuda_graph_share": round(sum(graph) / len(graph), 4) if graph else None}


GAP_REGIONS = ((1, 15), (16, 47), (48, 95), (96, 1 << 20))


def prefill_window_cost(text, interval=10, max_prefills=3):
    """What a prefill iteration adds to a decode window, from SGLang's log lines alone (so for every server, the
    no-spec one too; the plugin's telemetry times its own exactly: iteration_gaps). A `Decode batch` line closes a
    window of `interval` decode steps (--decode-log-interval) whose wall time, prefills included, its throughput
    gives (interval x the line's step); per batch region (GAP_REGIONS), `clean_step_ms` is the median step of the
    windows without a prefill, and `per_prefill_ms` the median over the windows with 1..max_prefills prefills of
    (window - interval x clean step) / prefills: the prefill iteration and whatever it costs the steps around it.
    {"lo-hi": {"clean_step_ms", "clean_windows", "per_prefill_ms", "prefill_windows", "new_tokens_per_prefill"}}.
    2026-12-07, H100, flashinfer, 8b, c = 64: no-spec 31-34 ms, the decode state 39-43 ms a prefill."""
    rows, k, new = [], 0, 0
    for ln in text.splitlines():
        if "Prefill batch" in ln:
            t = R_PREFILL_TOKENS.search(ln)
            k, new = k + 1, new + (int(t.group(1)) if t else 0)
            continue
        if "Decode batch" not in ln:
            continue
        a, b, c = R_RUN.search(ln), R_ACC.search(ln), R_TP.search(ln)
        if a and c and float(c.group(1)) > 0:
            n = int(a.group(1))
            rows.append((n, 1000.0 * n * (float(b.group(1)) if b else 1.0) / float(c.group(1)), k, new))
        k, new = 0, 0
    rows = rows[1:]  # the first window spans whatever came before the log
    out = {}
    for lo, hi in GAP_REGIONS:
        sel = [r for r in rows if lo <= r[0] <= hi]
        clean = [r[1] for r in sel if r[2] == 0]
        if not clean:
            continue
        cm = st.median(clean)
        pre = [r for r in sel if 1 <= r[2] <= max_prefills]
        reg = {"clean_step_ms": round(cm, 3), "clean_windows": len(clean), "prefill_windows": len(pre)}
        if pre:
            reg["per_prefill_ms"] = round(st.median(interval * (r[1] - cm) / r[2] for r in pre), 2)
            reg["new_tokens_per_prefill"] = round(sum(r[3] for r in pre) / sum(r[2] for r in pre), 1)
        out[_gap_region(lo)] = reg
    return out


def _gap_region(batch_size):
    return next(f"{lo}-{hi if hi < 1 << 20 else ''}" for lo, hi in GAP_REGIONS if lo <= batch_size <= hi)


def _step_pairs(steps):
    """Consecutive step records of one rank, in iteration order: (a, b, iterations from a to b)."""
    steps = sorted((s for s in steps if s.get("iter") is not None), key=lambda s: (s.get("rank", 0), s["iter"]))
    return ((a, b, b["iter"] - a["iter"]) for a, b in zip(steps, steps[1:]) if a.get("rank", 0) == b.get("rank", 0))


def iteration_gaps(steps, max_gap_ms=1000.0):
    """From the plugin's step telemetry (dicts with iter, ts, step_ms, batch_size, config.steps): the wall time
    that ONE other scheduler iteration (a prefill) takes between two decode steps — launch to launch less the
    first step's own forward, where exactly one iteration number was skipped — per configuration of the step
    before it and batch region: {(steps, "lo-hi"): [n, median ms]}. Longer gaps (an idle server) are left out."""
    by: dict = {}
    for a, b, d in _step_pairs(steps):
        if d != 2:
            continue
        gap = 1000.0 * (b["ts"] - a["ts"]) - float(a["step_ms"])
        if not 0.0 < gap + float(a["step_ms"]) <= max_gap_ms:
            continue
        by.setdefault((int(a["config"]["steps"]), _gap_region(a["batch_size"])), []).append(gap)
    return {k: [len(v), round(st.median(v), 2)] for k, v in sorted(by.items())}


def steps_after_prefill(steps):
    """From the plugin's step telemetry (as iteration_gaps takes it): the step's own time (step_ms: its CUDA
    events, the worker's host work before the target launch included when the GPU waited for it) of a decode
    step right after another decode step (the iteration before it was that step) and of one right after
    exactly one other iteration (a prefill), per configuration and batch region: {(steps, "lo-hi"):
    {"after_step": [n, median ms], "after_prefill": [n, median ms]}}. After a prefill the GPU has run dry, so
    what the worker does on the host before its first launch shows in the second (2026-12-03, third lease: the
    decode state at batch >= 96 10.81-10.89 against 9.41-9.52 ms)."""
    by: dict = {}
    for _, b, d in _step_pairs(steps):
        if d not in (1, 2) or not b.get("step_ms"):
            continue
        by.setdefault((int(b["config"]["steps"]), _gap_region(b["batch_size"])), {}).setdefault(
            "after_step" if d == 1 else "after_prefill", []).append(float(b["step_ms"]))
    return {k: {w: [len(v), round(st.median(v), 2)] for w, v in sorted(ws.items())} for k, ws in sorted(by.items())}


def telemetry_step_points(steps, levels, width=1 / 16):
    """From a plugin server's step telemetry (as iteration_gaps takes it): per configuration (steps, topk,
    draft_tokens) and level L, the median own time (step_ms) of the decode steps right after another decode step
    (consecutive iteration numbers: no prefill between) at batch sizes L - floor(L x width) .. L:
    {config: [[L, median ms, steps]]}. What the plugin's telemetry adds to a cost profile where a level's
    `Decode batch` windows all hold a prefill (a closed loop whose c requests start together at c >= 64 logs no
    clean window); 2026-12-07, H100, MoE, c = 1 ... 32: within 1 % of the log lines' clean medians."""
    by: dict = {}
    for _, b, d in _step_pairs(steps):
        if d != 1 or not b.get("step_ms"):
            continue
        cfg = (int(b["config"]["steps"]), int(b["config"].get("topk", 1)), int(b["config"].get("draft_tokens", 1)))
        for lv in levels:
            if lv - int(lv * width) <= b["batch_size"] <= lv:
                by.setdefault(cfg, {}).setdefault(lv, []).append(float(b["step_ms"]))
    return {cfg: [[lv, round(st.median(v), 4), len(v)] for lv, v in sorted(ls.items())] for cfg, ls in sorted(by.items())}


def write_record(path, rec):
    """A results record to `path`, atomically (controller.state.atomic_write, no .prev kept); the "notes" of the
    record it replaces are kept (they are written by hand into a record that its script rebuilds from the calls)."""
    from pathlib import Path

    from specctl.controller.state import atomic_write

    if os.path.exists(path):
        with open(path) as f:
            notes = json.load(f).get("notes")
        if notes:
            rec["notes"] = notes
    atomic_write(Path(path), json.dumps(rec, indent=1).encode(), keep_prev=False)


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}  # Student t, 95 %, by n


def alt_phases(concurrencies, duration_s=15):
    """--phase-set alternating: at each concurrency a short-prompt phase, then a long-prompt one. The
    concurrencies should lie between the long prompts' spec->off crossover and the short ones', where one table
    for any context must be wrong for one of them: 32 / 48 (the default) for the H200 testbed's 2026-12-01
    tables; on SGLang's stock verify kernel (+stockverify) the H100 testbed's lie far lower (2026-12-06: s3 at
    ~690 tokens of context 1.58-1.64x the no-spec step at c = 4-16 and 2.05x at 32, at ~6,300 tokens 3.5-3.6x at
    every c), hence 8 / 16 there."""
    cs = [int(c) for c in (concurrencies.split(",") if isinstance(concurrencies, str) else concurrencies)
          if str(c).strip()]
    if not cs or min(cs) < 1:
        raise ValueError(f"alternating phases need concurrencies >= 1, got {concurrencies!r}")
    return [{"duration_s": duration_s, "concurrency": c, "mix": {cls: 1.0}} for c in cs for cls in ("short", "long")]


def ctx_pairs(policies):
    """(specctl<suffix>, specctl-noctx<suffix>) for every suffix both ran (e.g. +stockverify: the context axis
    where verify depends on the context the most), the plain pair first."""
    out = []
    for p in policies:
        if p.startswith("specctl") and not p.startswith("specctl-"):
            other = "specctl-noctx" + p[len("specctl"):]
            if other in policies:
                out.append((p, other))
    return sorted(out, key=lambda ab: (ab[0] != "specctl", ab[0]))


def paired_ratios(a, b):
    """a[i] / b[i] for the pairs where both are measured (one pair per round or repetition): every ratio, mean,
    median, range, standard error and a 95 % t interval of the mean; {} when no pair is measured."""
    r = [x / y for x, y in zip(a, b) if x and y]
    if not r:
        return {}
    out = {"per_round": [round(x, 4) for x in r], "mean": round(st.mean(r), 4), "median": round(st.median(r), 4),
           "min": round(min(r), 4), "max": round(max(r), 4), "pairs": len(r)}
    if len(r) > 1:
        se = st.stdev(r) / len(r) ** 0.5
        half = T95.get(len(r), 2.0) * se
        out["sem"] = round(se, 4)
        out["ci95"] = [round(st.mean(r) - half, 4), round(st.mean(r) + half, 4)]
    return out


def gpu_benches(d):
    """(GPU index, bench JSON, its path) of a device call's output folder: one bench-g<N>.json per GPU (sweep2)."""
    for g in range(8):
        p = os.path.join(d, f"bench-g{g}.json")
        if os.path.exists(p):
            with open(p) as f:
                yield g, json.load(f), p


def summarize_requests(outs, wall):
    """Aggregate client records {ttft, latency, tokens, verify_ct} of one run."""
    good = [o for o in outs if "error" not in o and o.get("tokens")]
    toks = sum(o["tokens"] for o in good)
    tpot = [1000.0 * (o["latency"] - (o["ttft"] or 0)) / (o["tokens"] - 1) for o in good if o["tokens"] > 1]
    vct = [o["verify_ct"] for o in good if o.get("verify_ct")]
    acc = (sum(o["tokens"] for o in good if o.get("verify_ct")) / sum(vct)) if vct else None
    r = lambda x, d=3: None if x is None else round(x, d)  # noqa: E731
    return {"requests": len(good), "errors": len(outs) - len(good), "output_tokens": toks, "wall_s": r(wall),
            "output_tokens_per_s": r(toks / wall if wall > 0 else None, 1), "median_tpot_ms": r(pct(tpot, 0.5)),
            "p99_tpot_ms": r(pct(tpot, 0.99)), "median_ttft_ms": r(pct([1000 * o["ttft"] for o in good if o.get("ttft")], 0.5)),
            "accept_length": r(acc)}


def phase_summary(outs, phases, t_first):
    """Per phase of one phase-workload run: its concurrency, the requests sent in it (errors apart), their median
    TPOT, and two throughputs over the phase's window. `output_tokens_per_s`: the tokens the server produced inside
    the window, each request's tokens spread evenly from its first token to its end (streamed requests: end -
    latency + ttft), whichever phase sent it; the drain after the last phase belongs to no phase. At
    --phase-scale 0.3 a phase lasts 3 s, about one request's life at c = 128, so counting whole requests by where
    they end (`finished_tokens_per_s`, the figure until 2026-12-03, the last window running to the last request)
    credits a phase with the phase before it: the c = 1 phase read 2400+ tok/s from the c = 128 phase's drain."""
    rows, t = [], t_first
    last_end = max([o.get("t_end", t_first) for o in outs] + [t_first])
    good = [o for o in outs if "error" not in o and o.get("tokens")]
    spans = []
    for o in good:
        end = o["t_end"]
        first = end - o["latency"] + (o.get("ttft") or 0.0)
        spans.append((min(first, end), end, o["tokens"]))
    for k, ph in enumerate(phases):
        lo, hi = t, t + ph["duration_s"]
        t = hi
        last = k == len(phases) - 1
        fin_hi = max(hi, last_end) if last else hi
        sent = [o for o in good if o.get("phase") == k]
        done = [o for o in good if lo <= o.get("t_end", -1) and (o["t_end"] <= fin_hi if last else o["t_end"] < fin_hi)]
        made = 0.0
        for a, b, n in spans:
            if b > a:
                made += n * max(0.0, min(hi, b) - max(lo, a)) / (b - a)
            elif lo <= b < hi:  # all of it at once (a one-token request)
                made += n
        tpot = [1000.0 * (o["latency"] - (o["ttft"] or 0)) / (o["tokens"] - 1) for o in sent if o["tokens"] > 1]
        dur = hi - lo
        rows.append({"phase": k, "concurrency": ph["concurrency"], "requests": len(sent),
                     "errors": sum(1 for o in outs if o.get("phase") == k and "error" in o),
                     "output_tokens_per_s": round(made / dur, 1) if dur > 0 else None,
                     "finished_tokens_per_s": round(sum(o["tokens"] for o in done) / (fin_hi - lo), 1)
                     if fin_hi > lo else None,
                     "median_tpot_ms": None if not tpot else round(pct(tpot, 0.5), 3)})
    return rows


def profile_from_runs(runs, name, source="log"):
    """Simulator cost profile (specctl.profile/1) from the static/off sweep rows.
    source="log": median step time of SGLang's Decode-batch lines at that batch size; source="client": median
    per-request time per decode step seen by the client, median_tpot_ms * accept_length (every request's whole
    decode, so it also carries the prefills of requests joining a closed loop)."""
    cfgs, step_ms, cvs = {}, {}, []
    for row in runs:
        p = parse_policy(row["policy"])
        if p["kind"] == "off":
            key, c = "off", {"steps": 0, "topk": 1, "draft_tokens": 1}
        elif p["kind"] == "static":
            key = config_name(p["config"])
            c = dict(zip(("steps", "topk", "draft_tokens"), p["config"]))
        else:
            continue
        lg = row.get("log") or {}
        if source == "client":
            if not row.get("median_tpot_ms"):
                continue
            v = round(row["median_tpot_ms"] * (row.get("accept_length") or 1.0), 4)
        else:
            if not lg.get("step_ms_med"):
                continue
            v = lg["step_ms_med"]
        cfgs[key] = c
        step_ms.setdefault(key, []).append([row["concurrency"], v])
        if lg.get("step_ms_cv") is not None:
            cvs.append(lg["step_ms_cv"])
    for k in step_ms:
        step_ms[k].sort()
    return {"schema": "specctl.profile/1", "name": name, "configs": cfgs, "step_ms": step_ms,
            "noise_cv": round(st.median(cvs), 4) if cvs else 0.05}


# The plugin holding steps 0 with every change of its own off: SGLang's steps-0 state as SGLang ships it
# (the trivial verify, the extend verify kernel, the launch-width draft-extend graph)
SGLANG_STEPS0 = {"plain_decode": False, "splitkv_verify": False, "draft_extend_graphs": False}
PATH_DEFAULTS = {"plain_decode_flashinfer": True, "host_seq_lens": True}  # switches a profile's build reads as none
PATH_BUILDS = {
    "sglang": "SGLang's EAGLE-3 server as it ships: sN = static:sN (no plugin), off = its steps-0 state (the trivial "
              "verify), held at every batch size by the plugin with its own changes off "
              "(plugin-fixed:1:s3+verify+stockverify+nodeg)",
    "specctl": "the EAGLE-3 server with the plugin's defaults: off = the decode state (plugin-fixed:1:s3), sN = "
               "plugin-fixed:T:sN with T above every measured batch size (the split-KV verify kernel, each state's "
               "draft-extend graph at its own width)",
}


def path_config(pol, max_level):
    """(build, config name) of the cost profile a run of `pol` measures (issue "cheaper speculative steps",
    item 3), or None: 'nospec' (a server launched without speculation: off), or a PATH_BUILDS key. Runs that
    measure no one configuration of one build give None: thresholds that switch inside the sweep, trees,
    SGLang's adaptive policy, specctl, eager / overlap-off servers, any other mix of plugin switches."""
    p = parse_policy(pol)
    if p.get("server_flags") or p.get("skip_zero_draft_extend") or any(p.get(x) for x in SERVER_ACTIONS.values()):
        return None
    if p["kind"] == "off":
        return "nospec", "off"
    cfg = p.get("config")
    if cfg is None or cfg[1] != 1:
        return None
    if p["kind"] == "static":
        return "sglang", config_name(cfg)
    if p["kind"] != "plugin-fixed" or 1 < p["threshold"] <= max_level:
        return None
    name = "off" if p["threshold"] <= 1 else config_name(cfg)
    # +fi and +hostlens name the plugin's defaults since 2026-12-06 (+deg and +splitkv keep their older meaning
    # here: the records of before their defaults read them as changes)
    switches = {f: p[f] for f, *_ in PLUGIN_SWITCHES.values() if f in p and PATH_DEFAULTS.get(f) is not p[f]}
    if not switches:
        return "specctl", name
    if name == "off" and switches == SGLANG_STEPS0:
        return "sglang", "off"
    return None


def path_profiles(runs, name, max_level=None):
    """One simulator cost profile (specctl.profile/1) per PATH_BUILDS build from run_bench rows of one or more
    calls: per configuration and concurrency the median over rounds of the round's median step over the
    `Decode batch` windows without a prefill (`clean_step_ms_med`). A point where no round has a clean window is
    left out (`source.no_clean_window` names those points): its all-windows median holds prefill iterations of
    ~50-70 ms (2026-12-02: s3 "33 ms" at c = 64 where its decode steps take 12.8), a cost of the workload's
    arrivals, not of the configuration's step; the simulator extends the curve from its last points. noise_cv: the median over rounds of the clean windows' step-time cv (0.05 where no round has one;
    bench JSONs from before 2026-12-02's third lease have none). Each profile carries the no-spec server's curve
    (`source.no_spec_step_ms`) for the crossover."""
    levels = [r["concurrency"] for r in runs if r.get("concurrency")]
    top = max_level if max_level is not None else max(levels, default=0)
    pts, cvs = {}, {}
    for r in runs:
        where = path_config(r["policy"], top)
        lg = r.get("log") or {}
        if where is None or not r.get("concurrency") or not lg.get("step_ms_med"):
            continue
        pts.setdefault(where, {}).setdefault(r["concurrency"], []).append(
            (lg.get("clean_step_ms_med"), lg["step_ms_med"]))
        if lg.get("clean_step_ms_cv") is not None:  # a prefill inside a window is not step noise
            cvs.setdefault(where[0], []).append(lg["clean_step_ms_cv"])

    def curve(where):
        out, loose = [], []
        for c, rounds in sorted(pts.get(where, {}).items()):
            clean = [x for x, _ in rounds if x]
            if clean:
                out.append([c, round(st.median(clean), 4)])
            else:
                loose.append(c)
        return out, loose

    no_spec, _ = curve(("nospec", "off"))
    profiles = {}
    for build, what in PATH_BUILDS.items():
        names = sorted({cfg for b, cfg in pts if b == build}, key=lambda n: parse_config(n)[0] if n != "off" else 0)
        if not names:
            continue
        step_ms, configs, loose = {}, {}, {}
        for n in names:
            step_ms[n], lo = curve((build, n))
            if not step_ms[n]:
                del step_ms[n]
                loose[n] = lo
                continue
            c = OFF if n == "off" else parse_config(n)
            configs[n] = dict(zip(("steps", "topk", "draft_tokens"), c))
            if lo:
                loose[n] = lo
        if not step_ms:
            continue
        profiles[build] = {"schema": "specctl.profile/1", "name": f"{name}-{build}", "configs": configs,
                           "step_ms": step_ms,
                           "noise_cv": round(st.median(cvs[build]), 4) if cvs.get(build) else 0.05,
                           "source": {"build": what, "no_spec_step_ms": no_spec, "no_clean_window": loose,
                                      "method": "median over rounds of each round's median SGLang `Decode batch` "
                                                "step without a prefill since the previous line"}}
    return profiles


def profile_with_ctx(rows, name, source=None):
    """Simulator cost profile with a context term (specctl.profile/1, README "Cost profile") from wave rows
    {policy, prompt_tokens, concurrency, step_ms, ctx_per_req} of off / static policies measured at two or more
    prompt lengths (ctx_profile.py): the shortest prompt length's curves are `step_ms` at `ctx_tokens` (the
    median mean context per request of its waves), every other length one `ctx_step_ms` entry. A config
    missing at some (length, concurrency) is left out at that concurrency in every curve; lengths whose
    configs share no concurrency are dropped."""
    cfgs, by = {}, {}
    for r in rows:
        if not r.get("step_ms"):
            continue
        p = parse_policy(r["policy"])
        if p["kind"] == "off":
            key, c = "off", {"steps": 0, "topk": 1, "draft_tokens": 1}
        elif p["kind"] == "static":
            key, c = config_name(p["config"]), dict(zip(("steps", "topk", "draft_tokens"), p["config"]))
        else:
            continue
        cfgs[key] = c
        by.setdefault(r["prompt_tokens"], {}).setdefault(key, {})[r["concurrency"]] = r
    lengths = sorted(L for L, d in by.items() if set(d) == set(cfgs))
    if len(lengths) < 2:
        raise ValueError(f"need every configuration ({', '.join(sorted(cfgs))}) at two or more prompt lengths; "
                         f"have {sorted(by)} with {[sorted(by[L]) for L in sorted(by)]}")
    levels = sorted(set.intersection(*[set(by[L][k]) for L in lengths for k in cfgs]))
    if not levels:
        raise ValueError("no concurrency measured for every configuration at every prompt length")

    def curves(L):
        return {k: [[c, by[L][k][c]["step_ms"]] for c in levels] for k in cfgs}

    def ctx_of(L):
        v = [by[L][k][c].get("ctx_per_req") for k in cfgs for c in levels if by[L][k][c].get("ctx_per_req")]
        return round(st.median(v), 1) if v else float(L)

    cvs = [r["step_ms_cv"] for r in rows if r.get("step_ms_cv") is not None]
    prof = {"schema": "specctl.profile/1", "name": name, "configs": cfgs, "step_ms": curves(lengths[0]),
            "ctx_tokens": ctx_of(lengths[0]),
            "ctx_step_ms": [{"ctx_tokens": ctx_of(L), "step_ms": curves(L)} for L in lengths[1:]],
            "noise_cv": round(st.median(cvs), 4) if cvs else 0.05}
    if source is not None:
        prof["source"] = source
    return prof


def table_flaps(table_rows):
    """Speculating rows after the first plain-decode row of one table (0: speculate below one batch size, decode
    plainly from it up). `table_rows`: [(min_batch, steps)] in batch order."""
    seen_off, flaps = False, 0
    for _, steps in table_rows:
        if steps == 0:
            seen_off = True
        elif seen_off:
            flaps += 1
    return flaps


def policy_flaps(policy):
    """table_flaps of a policy JSON object: the rows for any context and each context band's."""
    groups = {}
    for r in policy["table"]:
        band = None if r.get("min_ctx") is None and r.get("max_ctx") is None else (r.get("min_ctx") or 0, r.get("max_ctx"))
        groups.setdefault(band, []).append((r["min_batch"], r["config"]["steps"]))
    return {("any" if b is None else f"{b[0]}+" if b[1] is None else f"{b[0]}-{b[1]}"): table_flaps(rows)
            for b, rows in groups.items()}


def prefill_report(probes, ref_policy="off"):
    """probes: {policy: {prompt id: {"prompt_lp": [log p of each prompt token after the first], "first_top2":
    [[logprob, token id], ...]}}} (run_bench's prefill probe) -> per policy against `ref_policy`: how many prompts'
    prefill log-probabilities are bit-for-bit the reference's (`identical`), the largest and the median of the
    prompts' largest |difference|, the share of positions that differ at all, the first position that differs per
    prompt, and how many first output tokens match (`first_token_same`) with the largest |difference| of their
    log-probability. Equal prefills and a later parting put the cause in the decode steps; unequal ones, in the
    prefill (what the speculative server's target forward does differently)."""
    ref = probes.get(ref_policy) or {}
    rep = {}
    for pol, per in probes.items():
        if pol == ref_policy or not ref:
            continue
        n = same = tok_same = pos = pos_diff = 0
        worst, first, tok_d = [], {}, []
        for pid, x in per.items():
            r = ref.get(pid)
            a, b = (x or {}).get("prompt_lp"), (r or {}).get("prompt_lp")
            if not a or not b or len(a) != len(b) or any(v is None for v in a + b):
                continue
            n += 1
            d = [abs(u - v) for u, v in zip(a, b)]
            pos += len(d)
            pos_diff += sum(1 for v in d if v > 0)
            worst.append(max(d))
            if max(d) == 0:
                same += 1
            else:
                first[pid] = next(i for i, v in enumerate(d) if v > 0)
            ta, tb = (x or {}).get("first_top2") or [], (r or {}).get("first_top2") or []
            if ta and tb:
                tok_same += ta[0][1] == tb[0][1]
                if ta[0][1] == tb[0][1] and ta[0][0] is not None and tb[0][0] is not None:
                    tok_d.append(abs(ta[0][0] - tb[0][0]))
        if not n:
            rep[pol] = None
            continue
        worst.sort()
        rep[pol] = {"prompts": n, "identical": same, "max_abs_diff": round(worst[-1], 6),
                    "median_max_abs_diff": round(worst[len(worst) // 2], 6),
                    "positions_differing": round(pos_diff / pos, 4) if pos else None,
                    "first_differing_position": first, "first_token_same": tok_same,
                    "first_token_max_abs_diff": round(max(tok_d), 6) if tok_d else None}
    return rep


def logit_report(tops, ref_policy="off", identity=None):
    """tops: {policy: {prompt id: [[logprob 1, id 1, logprob 2, id 2] per output position]}} (the identity
    probe's logprob pass: the no-spec server's, and that of every server whose greedy steps answer logprob
    requests themselves, e.g. the decode state with +lp) -> per policy against `ref_policy`: per prompt the
    first output position whose top-2 differs at all (`first_logit_difference`; None where every position
    agrees bit for bit) and whose top-2 ids or gap differ (`first_margin_difference`: the logits themselves,
    whatever normalisation the server's log-probabilities went through), how many prompts agree everywhere, and — with identity (identity_report's output) —
    how many part in their top-2 before their tokens part. Where the logits differ from the first decode step
    on, the decode forward itself computes differently; where they agree up to a token parting, it does not."""
    ref = tops.get(ref_policy) or {}
    rep = {}
    for pol, per in tops.items():
        if pol == ref_policy or not ref:
            continue
        first, margin = {}, {}
        for pid, rows in per.items():
            r = ref.get(pid)
            if not rows or not r:
                continue
            first[pid] = next((i for i, (x, y) in enumerate(zip(rows, r)) if x != y), None)
            margin[pid] = next((i for i, (x, y) in enumerate(zip(rows, r))
                                if (x[1], x[3]) != (y[1], y[3]) or abs((x[0] - x[2]) - (y[0] - y[2])) > 1e-6), None)
        out = {"prompts": len(first), "agree_everywhere": sum(1 for k in first.values() if k is None),
               "first_logit_difference": {p: k for p, k in sorted(first.items()) if k is not None},
               # shift-free: the top-2 ids or their log-probability gap (a logit difference) — 2026-12-02 the +lp
               # server's log-probabilities sat a constant off the no-spec server's even at the prefill's output
               "first_margin_difference": {p: k for p, k in sorted(margin.items()) if k is not None}}
        div = ((identity or {}).get(pol) or {}).get("first_divergence")
        if div is not None:
            out["logits_part_before_tokens"] = sum(1 for p, k in first.items()
                                                   if k is not None and (p not in div or k < div[p]))
        rep[pol] = out
    return rep


def identity_report(outputs, ref_policy="off", margins=None):
    """outputs: {policy: {prompt id: greedy output ids}} -> per policy, how many prompts match `ref_policy`'s
    token for token and where the first differing token is (None where identical). With margins ({prompt id:
    the reference's log p(top-1) - log p(top-2) per output position}): each divergence's margin there
    (`margin_at_divergence`; a near-tie reads ~0) and, for scale, the median margin of the prompt's positions."""
    ref = outputs.get(ref_policy)
    rep = {}
    for pol, outs in outputs.items():
        if ref is None:
            rep[pol] = None
            continue
        firsts = {}
        for pid, ids in outs.items():
            r = ref.get(pid)
            if r is None or ids is None:
                continue
            k = next((i for i, (x, y) in enumerate(zip(ids, r)) if x != y), None)
            if k is None and len(ids) != len(r):
                k = min(len(ids), len(r))
            firsts[pid] = k
        rep[pol] = {"identical": sum(1 for k in firsts.values() if k is None), "of": len(firsts),
                    "first_divergence": {p: k for p, k in sorted(firsts.items()) if k is not None}}
        if margins:
            at, typical = {}, []
            for p, k in rep[pol]["first_divergence"].items():
                m = margins.get(p) or []
                if k < len(m) and m[k] is not None:
                    at[p] = round(m[k], 5)
            for m in margins.values():
                typical += [x for x in (m or []) if x is not None]
            rep[pol]["margin_at_divergence"] = at
            if typical:
                rep[pol]["median_margin"] = round(sorted(typical)[len(typical) // 2], 5)
    return rep

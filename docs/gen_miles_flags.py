"""Writes docs/miles-flags.md: every flag of Miles' `miles/utils/arguments.py` (and the
Megatron flags Miles' scripts pass), with what `miles` (miles-cli/src/args.rs) does with it, and
the table of the flags `miles` accepts and ignores (miles-cli/src/miles_flags.rs).

    python3 docs/gen_miles_flags.py /path/to/radixark-miles/miles/utils/arguments.py && cargo fmt

The FSDP backend's flags (the fields of `FSDPArgs`, `miles/backends/fsdp_utils/arguments.py`,
found beside it) are listed too. Flags under Miles' `--sglang-` / `--eval-sglang-` prefixes
(SGLang's server arguments, passed through) are not listed: `miles` ignores them by prefix.

Miles commit used for the checked-in table: 31f1ca961a94 (2026-08-21).
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
miles_args = Path(sys.argv[1]).read_text()
ours_src = (ROOT / "miles-cli/src/args.rs").read_text()
body = ours_src[ours_src.index("pub struct TrainArgs"):ours_src.index("pub struct ServeArgs")]
ours = {"--" + f.replace("_", "-") for f in re.findall(r"pub (\w+): ", body)
        if f not in ("model", "data", "rollout", "train", "lora", "eval", "reward", "agent", "opd",
                     "metrics")}
ours |= {"--" + a for a in re.findall(r'alias = "([a-z0-9-]+)"', body)}

# Megatron / torch flags Miles' example scripts pass (not in arguments.py).
MEGATRON = ["--lr", "--min-lr", "--lr-warmup-iters", "--lr-decay-style", "--lr-decay-iters",
            "--clip-grad", "--weight-decay", "--adam-beta1", "--adam-beta2", "--seed", "--load",
            "--save", "--save-interval", "--global-batch-size", "--micro-batch-size", "--bf16",
            "--fp16", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
            "--context-parallel-size", "--expert-model-parallel-size", "--sequence-parallel",
            "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu"]

# Flags that exist as a field of a library config type but not (yet) on the command line.
LIBRARY = {
    "--ref-update-interval": "TrainConfig::ref_update_interval",
    "--use-dynamic-batch-size": "TrainConfig::use_dynamic_batch_size",
    "--max-tokens-per-gpu": "TrainConfig::max_tokens_per_gpu",
    "--adam-beta1": "AdamWConfig::beta1", "--adam-beta2": "AdamWConfig::beta2",
    "--kl-coef": "AdvantageConfig::kl_coef", "--gamma": "AdvantageConfig::gamma",
    "--lambd": "AdvantageConfig::lambd",
    "--disable-grpo-std-normalization": "AdvantageConfig",
    "--eps-clip-c": "PolicyLossConfig::eps_clip_c",
    "--use-unbiased-kl": "PolicyLossConfig", "--loss-type": "TrainConfig::loss_type",
    "--value-clip": "TrainConfig::value_clip", "--critic-lr": "TrainConfig::critic_lr",
    "--lora-dropout": "TrainConfig::lora_dropout (0 only)",
    "--exclude-modules": "TrainConfig::exclude_modules",
    "--lora-adapter-path": "TrainConfig::lora_adapter_path",
    "--pause-generation-mode": "LoopConfig::pause_generation_mode",
    "--async-data-buffer-capacity-factor": "LoopConfig::async_data_buffer_capacity_factor",
    "--unused-samples-handler": "LoopConfig::unused_samples_handler",
    "--use-tis": None, "--tis-clip-low": "PolicyLossConfig",
    "--use-mis": "PolicyLossConfig (MIS)", "--use-icepop": "PolicyLossConfig (ICEPOP)",
    "--sglang-server-concurrency": "RolloutConfig::max_concurrency",
    "--normalize-advantages": "AdvantageConfig",
    "--session-server-ip": "miles-session binary --host",
    "--session-server-port": "miles-session binary --port",
    "--tito-model": "miles-session binary --tito",
}
# Miles' flags whose function `miles` covers under another name.
RENAMED_EXTRA = {
    "--tito-model": "--tito (the session server's TITO family; alias accepted)",
    "--custom-agent-function-path": "--agent-cmd (a subprocess agent in any language)",
    "--rollout-num-gpus": "--device / --rollout-device",
}
RENAMED = {
    "--tb-project-name": "--tensorboard-dir (alias accepted)",
    "--prometheus-port": "--metrics-port (Miles' spelling accepted with --use-prometheus)",
}
# Flags whose function does not exist in one process with one trainer (the rest of their
# group is handled by the group rule below).
NOT_APPLICABLE = {
    "--balance-data": "balances prompts across data-parallel ranks; one trainer here",
    "--train-backend": "Megatron or FSDP; one burn trainer here",
    "--update-weight-buffer-size": "the bucket size of the NCCL weight broadcast; weights go to engines as files here",
    "--train-env-vars": "environment of the Ray train actors; one process here",
    "--eval-num-gpus": "a dedicated evaluation fleet on GPUs of its own, fed HF snapshots; evaluation here runs on the rollout engines at the eval step",
    "--eval-num-gpus-per-engine": "the tensor-parallel size of the dedicated evaluation fleet (see --eval-num-gpus)",
    "--eval-hf-dir": "where the dedicated evaluation fleet's HF snapshots are staged; evaluation here reads the live weights, no snapshot is written",
    "--eval-max-in-flight": "bound on asynchronous snapshot evaluations of the dedicated fleet; evaluation here runs in line at the eval step",
    "--eval-overflow-policy": "what the dedicated fleet does when --eval-max-in-flight evaluations are pending; evaluation here runs in line at the eval step",
    "--eval-keep-snapshots": "how many of the dedicated fleet's snapshots are kept; no snapshot is written here",
}
FSDP_REASON = "not applicable: an FSDP backend setting (torch memory, attention kernel, profiling); the burn trainer has its own"
GROUP_REASON = {
    "add_cluster_arguments": "not applicable: Ray / GPU placement of actor, critic and engines; one process here (devices: --device / --rollout-device)",
    "add_debug_arguments": "not applicable: Miles' debugging / dumping hooks",
    "add_ci_arguments": "not applicable: Miles' own CI switches",
    "add_wandb_arguments": "not built in: write --use-tensorboard files and `wandb sync --sync-tensorboard`",
    "add_mlflow_arguments": "not built in: MLflow logging",
    "add_rollout_buffer_arguments": "not applicable: Miles' external rollout-buffer service",
    "add_fault_tolerance_arguments": "not applicable: Ray actor restarts; engines here are health-checked and re-created by the Router",
    "add_custom_megatron_plugins_arguments": "not applicable: Megatron plugins",
    "add_mtp_training_arguments": "not supported: MTP layers are skipped at load",
    "add_prefill_decode_disaggregation_arguments": "not applicable: SGLang PD disaggregation",
    "add_network_arguments": "not applicable: Ray networking",
    "add_router_arguments": "not applicable: external sglang_router; the in-process Router is used (--engine-url repeatable)",
    "add_user_provided_function_arguments": "not applicable: Python import paths; implement the Rust trait, or use --agent-cmd / --rm-url",
    "megatron": "not applicable: Megatron parallelism / precision (see COMPATIBILITY.md)",
}
PYTHON_PATH = re.compile(r"-path$|-function-path$|-hook-path$")

groups = [(m.start(), m.group(1)) for m in re.finditer(r"def (add_\w+_arguments)\(parser", miles_args)]
rows = []
seen = set()
arity = {}
for m in re.finditer(r'add_argument\(\s*((?:"--[\w-]+"\s*,\s*)+)', miles_args):
    names = re.findall(r'"(--[\w-]+)"', m.group(1))
    # The call's own keywords: up to the next add_argument.
    call = miles_args[m.end():miles_args.find("add_argument(", m.end())]
    if re.search(r'action\s*=\s*"store_(true|false)"', call):
        kind = "Switch"
    elif re.search(r'nargs\s*=\s*"[+*]"', call):
        kind = "Values"
    else:
        kind = "Value"
    arity.setdefault(names[0], kind)
    group = None
    for pos, g in groups:
        if pos < m.start():
            group = g
    if names[0] in seen:
        continue
    seen.add(names[0])
    rows.append((names[0], group))
MEGATRON_SWITCHES = {"--bf16", "--fp16", "--sequence-parallel", "--use-dynamic-batch-size"}
for f in MEGATRON:
    arity.setdefault(f, "Switch" if f in MEGATRON_SWITCHES else "Value")
    if f not in seen:
        rows.append((f, "megatron"))
        seen.add(f)
# The FSDP backend's dataclass fields (bools are BooleanOptionalAction: --x / --no-x).
fsdp_path = Path(sys.argv[1]).resolve().parent.parent / "backends/fsdp_utils/arguments.py"
if fsdp_path.exists():
    fsdp = fsdp_path.read_text()
    body = fsdp[fsdp.index("class FSDPArgs"):fsdp.index("def build_fsdp_parser")]
    for name, typ in re.findall(r"^    (\w+): ([^=\n]+?)\s*=", body, re.M):
        if name == "config":
            continue
        flag = "--" + name.replace("_", "-")
        forms = [flag, "--no-" + name.replace("_", "-")] if typ.strip() == "bool" else [flag]
        for f in forms:
            arity.setdefault(f, "Switch" if typ.strip() == "bool" else "Value")
            if f not in seen:
                rows.append((f, "fsdp"))
                seen.add(f)


def status(flag, group):
    # Miles' spellings we accept as aliases of a flag of ours stay "renamed".
    if flag in RENAMED and flag != "--prometheus-port":
        return "renamed", RENAMED[flag]
    if flag in RENAMED_EXTRA:
        return "renamed", RENAMED_EXTRA[flag]
    if flag == "--skip-actor-forward-only":
        return "automatic", ("the actor skips its old-log-prob forward whenever a call takes one "
                             "optimizer step and neither `--use-tis`, `--get-mismatch-metrics` nor "
                             "`--kl-coef` needs it (docs of `miles_train::Actor`); the flag is accepted and changes nothing")
    if flag == "--save-debug-trajectory-data":
        return "supported", ("with `--agent-cmd`: each session's conversation rides on its sample as "
                             "`metadata.messages`, as Miles' session server does, and each rollout's rows go to the JSONL file at PATH")
    if flag == "--offload-rollout":
        return "supported", ("embedded engine, `train`: on by default (the engine shares the trainer's "
                             "process, as Miles' `--colocate`, which turns it on); `--no-offload-rollout` "
                             "keeps the engine's memory; `train-async` generates while it trains and "
                             "never releases (see miles-cli/src/memory.rs)")
    if flag == "--offload-rollout-level":
        return "supported", "`kv_cache` and / or `weight` (default both)"
    if flag in ours:
        return "supported", ""
    if flag == "--session-sample-picker-path":
        return "not applicable", ("a Python import path: with tree sessions (`--use-session-server v2`) implement "
                                  "`miles_session::tree_samples::SamplePicker` (`SessionServerConfig::sample_hooks`); "
                                  "the default is Miles' `drop_retries` (`DropRetries`)")
    if flag == "--session-sample-postprocessor-path":
        return "not applicable", ("a Python import path: implement `miles_session::tree_samples::SamplePostprocessor` "
                                  "(`SessionServerConfig::sample_hooks`); the default is Miles' `default_postprocess` "
                                  "(`DefaultPostprocess`)")
    if flag in LIBRARY and LIBRARY[flag]:
        return "library only", f"`{LIBRARY[flag]}`; not on the command line yet"
    if flag == "--dynamic-sampling-filter-path":
        return "supported", "built-in filter names"
    if flag in NOT_APPLICABLE:
        return "not applicable", "not applicable: " + NOT_APPLICABLE[flag]
    if group == "fsdp":
        return "not applicable", FSDP_REASON
    if PYTHON_PATH.search(flag):
        return "not applicable", "a Python import path: implement the Rust trait (`RewardFn`, `SampleGenerator`, `Agent`), or use --agent-cmd / --rm-url"
    if group in GROUP_REASON:
        return "not applicable", GROUP_REASON[group]
    return "not supported yet", f"Miles group `{group}`"


out = ["# Miles' flags in `miles`", "",
       "Generated by `docs/gen_miles_flags.py` from Miles' `miles/utils/arguments.py` (commit",
       "31f1ca961a94) plus the Megatron flags Miles' scripts pass and the FSDP backend's. *supported*: same name and",
       "meaning; *renamed*: ours in the note (Miles' name accepted where said); *library only*: a",
       "field of a config type, not a flag yet; *not applicable*: what it configures does not exist",
       "here, with the reason: `miles train` / `train-async` / `sft` / `eval` accept these and name",
       "them in one warning, as they do every flag under Miles' `--sglang-` / `--eval-sglang-`",
       "prefixes (SGLang's server arguments: configure the SGLang servers of `--engine-url`",
       "yourself) but `--sglang-mem-fraction-static`, the share of memory the embedded engine's",
       "KV pool may take, and `--sglang-max-total-tokens`, the most tokens it holds. The FSDP",
       "backend's flags (`FSDPArgs`) are listed too.", "",
       "| Miles flag | status | note |", "|---|---|---|"]
counts = {}
for flag, group in rows:
    st, note = status(flag, group)
    counts[st] = counts.get(st, 0) + 1
    out.append(f"| `{flag}` | {st} | {note} |")
out += ["", "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""]
# `--sglang-*` flags are SGLang's server arguments, which Miles passes through (not listed above).
# `--no-X` of a Miles `BooleanOptionalAction` flag `--X` is Miles' own spelling.
extra = sorted(f for f in ours - seen - {"--config"} if not f.startswith("--sglang-")
               and not (f.startswith("--no-") and "--" + f[len("--no-"):] in seen))
# Flags Miles had before the commit above and removed.
HISTORICAL = {"--generate-multi-samples": "Miles' flag until b05a4f2a0 (2026-07-29)"}
out += ["Flags of `miles` that Miles does not have: "
        + ", ".join(f"`{f}`" + (f" ({HISTORICAL[f]})" if f in HISTORICAL else "") for f in extra) + "."]
(ROOT / "docs/miles-flags.md").write_text("\n".join(out) + "\n")

# The flags `miles` accepts with one warning and ignores: the not-applicable rows.
rs = ["//! Miles' flags that configure what does not exist here (Ray placement, Megatron",
      "//! parallelism, Miles' debugging hooks, …): `miles` accepts them with one warning naming them,",
      "//! so a Miles launch script runs. Generated by `docs/gen_miles_flags.py` (the \"not applicable\"",
      "//! rows of docs/miles-flags.md) from Miles' `miles/utils/arguments.py` at 31f1ca961a94.",
      "",
      "/// How many values a Miles flag takes.",
      "#[derive(Debug, Clone, Copy, PartialEq, Eq)]",
      "pub enum Arity {",
      "    /// None (`store_true` / `store_false`).",
      "    Switch,",
      "    /// One.",
      "    Value,",
      "    /// Every value up to the next flag (`nargs=\"+\"` / `\"*\"`).",
      "    Values,",
      "}",
      "",
      "/// The not-applicable flags and what each takes.",
      "pub const NOT_APPLICABLE: &[(&str, Arity)] = &["]
for flag, group in rows:
    st, _ = status(flag, group)
    if st == "not applicable":
        rs.append(f'    ("{flag}", Arity::{arity.get(flag, "Value")}),')
rs += ["];", ""]
(ROOT / "miles-cli/src/miles_flags.rs").write_text("\n".join(rs))
print(counts, len(rows))

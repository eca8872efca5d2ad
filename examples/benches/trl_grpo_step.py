"""TRL's GRPOTrainer on CPU: the baseline of the `grpo_step_vs_trl` bench.

Trains an HF checkpoint directory with GRPO on a JSONL prompt file (miles-rollout's default
keys: `input` holds the chat messages, `label` the answer), the chat template applied with
`enable_thinking: false`, TRL's own HF `generate` rollouts, an exact-match reward (the
response, cut at the first end-of-turn marker and trimmed, equals the label: miles'
`--rm-type exact_match` on a response that ends at EOS), and one optimizer step per
generation batch (`per_device_train_batch_size` = prompts x group size, no gradient
accumulation, `num_iterations` 1: TRL then uses the training forward's own log-probs as the
old ones). `beta` 0 (no reference model), as `miles train` without `--use-kl-loss`.

Prints one JSON line: seconds of every optimizer step (generation included), the peak RSS
of the process (MiB) and the mean reward of each step (TRL's logged `reward`: the mean
exact-match reward of the step's generations, before its update).

With `--stop-reward R` (the bench's time-to-reward rows) training stops after the first step
at which the mean reward of the last `--stop-window` steps is at least R (or at `--steps`).
`--seed` seeds TRL (sampling included).

Run: `python trl_grpo_step.py --model DIR --data train.jsonl --prompts 32 --group 8
--max-new-tokens 8 --lr 1e-4 --steps 3 --threads 2` (add `--steps 60 --stop-reward 0.8
--stop-window 3` for a time-to-reward run)
"""

import argparse
import json
import resource
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--output-dir", default="/tmp/trl_grpo_step")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stop-reward", type=float, default=None)
    ap.add_argument("--stop-window", type=int, default=3)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = []
    with open(args.data) as f:
        for line in f:
            r = json.loads(line)
            rows.append({"prompt": r["input"], "label": r["label"]})
            if len(rows) >= args.prompts * args.steps:
                break
    dataset = Dataset.from_list(rows)

    def exact_match(completions, label, **_):
        out = []
        for c, want in zip(completions, label):
            text = c[0]["content"] if isinstance(c, list) else c
            for stop in ("<|im_end|>", "<|endoftext|>"):
                text = text.split(stop)[0]
            out.append(1.0 if text.strip() == str(want).strip() else 0.0)
        return out

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    batch = args.prompts * args.group
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        num_iterations=1,
        temperature=args.temperature,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        shuffle_dataset=False,
        chat_template_kwargs={"enable_thinking": False},
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    class Clock(TrainerCallback):
        def __init__(self):
            self.started = None
            self.steps = []
            self.rewards = []

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.steps.append(time.perf_counter() - self.started)

        def on_log(self, _args, _state, control, logs=None, **__):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])
                window = self.rewards[-args.stop_window :]
                if (
                    args.stop_reward is not None
                    and len(window) == args.stop_window
                    and sum(window) / len(window) >= args.stop_reward
                ):
                    # The trainer checks this after the step's logging: no further step.
                    control.should_training_stop = True

    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(
        json.dumps(
            {
                "step_seconds": clock.steps,
                "peak_rss_mib": peak_mib,
                "rewards": clock.rewards,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()

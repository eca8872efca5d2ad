//! The synthetic task of the reference example: multi-digit addition with checkable answers.
//!
//! A seeded generator draws problems `a+b=` (each operand with a digit count drawn from
//! `min_digits..=max_digits`), [`AdditionTask::split`] makes disjoint train and held-out
//! sets (a held-out pair never appears in training, in either order), [`write_jsonl`] writes
//! them as the dataset lines miles-rollout's `DataSource` reads (`input` = chat messages,
//! `label` = the sum, `metadata` = the operands), and [`AdditionReward`] scores responses.
//!
//! ```
//! use miles_examples::addition::{AdditionTask, extract_answer};
//!
//! let task = AdditionTask { min_digits: 2, max_digits: 2, seed: 7 };
//! let split = task.split(100, 20)?;
//! let p = &split.train[0];
//! assert_eq!(p.question(), format!("{}+{}=", p.a, p.b));
//! assert_eq!(p.answer(), (p.a + p.b).to_string());
//! assert!(split.held_out.iter().all(|h| !split.train.contains(h)));
//! assert_eq!(extract_answer("<think>\n\n</think>\n\n47<|im_end|>"), "47");
//! # Ok::<(), miles_examples::Error>(())
//! ```

use std::collections::HashSet;
use std::io::Write as _;
use std::path::Path;

use miles_core::rng::SplitMix64;
use miles_core::{
    Error as CoreError, Message, Prompt, Result as CoreResult, Reward, RewardFn, Role, Sample,
    async_trait,
};
use miles_rollout::PromptRecord;
use serde_json::{Map, Value, json};

use crate::Error;

/// One problem: `a + b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AdditionProblem {
    /// First operand.
    pub a: u64,
    /// Second operand.
    pub b: u64,
}

impl AdditionProblem {
    /// Whether adding the operands column by column carries anywhere (`27+15`: yes, `12+35`:
    /// no).
    pub fn has_carry(&self) -> bool {
        let (mut a, mut b) = (self.a, self.b);
        while a > 0 || b > 0 {
            if a % 10 + b % 10 >= 10 {
                return true;
            }
            a /= 10;
            b /= 10;
        }
        false
    }

    /// The user's message: `"12+35="`.
    pub fn question(&self) -> String {
        format!("{}+{}=", self.a, self.b)
    }

    /// The label: the sum in decimal (`"47"`).
    pub fn answer(&self) -> String {
        (self.a + self.b).to_string()
    }

    /// The sum written by a careless labeller who forgets every carry: each column's digits
    /// added modulo 10 (`27+15` → `32`, `95+17` → `2`, leading zeros dropped). Equal to
    /// [`AdditionProblem::answer`] exactly when the problem has no carry.
    pub fn answer_without_carries(&self) -> String {
        let (mut a, mut b, mut place, mut sum) = (self.a, self.b, 1u64, 0u64);
        while a > 0 || b > 0 {
            sum += (a % 10 + b % 10) % 10 * place;
            a /= 10;
            b /= 10;
            place *= 10;
        }
        sum.to_string()
    }

    /// The prompt as chat messages (one user message).
    pub fn messages(&self) -> Vec<Message> {
        vec![Message::new(Role::User, self.question())]
    }

    /// The dataset line: `{"input": [{"role": "user", "content": "12+35="}], "label": "47",
    /// "metadata": {"a": 12, "b": 35}}` (miles-rollout's default keys).
    pub fn jsonl_value(&self) -> Value {
        json!({
            "input": [{"role": "user", "content": self.question()}],
            "label": self.answer(),
            "metadata": {"a": self.a, "b": self.b},
        })
    }

    /// The prompt record miles-rollout's `DataSource` takes, equal to what it parses from
    /// [`AdditionProblem::jsonl_value`].
    pub fn prompt_record(&self) -> PromptRecord {
        let mut metadata = Map::new();
        metadata.insert("a".into(), self.a.into());
        metadata.insert("b".into(), self.b.into());
        PromptRecord {
            prompt: Prompt::Messages(self.messages()),
            label: Some(self.answer()),
            metadata,
        }
    }
}

/// The task's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdditionTask {
    /// Fewest digits of an operand (≥ 1; one-digit operands include 0).
    pub min_digits: u32,
    /// Most digits of an operand (≤ 9).
    pub max_digits: u32,
    /// Generator seed.
    pub seed: u64,
}

impl Default for AdditionTask {
    /// Two-digit operands, seed 0.
    fn default() -> Self {
        Self {
            min_digits: 2,
            max_digits: 2,
            seed: 0,
        }
    }
}

/// Disjoint train and held-out problems.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdditionSplit {
    /// Training problems.
    pub train: Vec<AdditionProblem>,
    /// Evaluation problems, never seen in training (in either operand order).
    pub held_out: Vec<AdditionProblem>,
}

impl AdditionTask {
    fn check(&self) -> Result<(), Error> {
        if self.min_digits == 0 || self.min_digits > self.max_digits || self.max_digits > 9 {
            return Err(Error::Invalid {
                what: "digit range",
                reason: format!(
                    "need 1 <= min_digits <= max_digits <= 9, got {}..={}",
                    self.min_digits, self.max_digits
                ),
            });
        }
        Ok(())
    }

    /// How many distinct ordered pairs the digit range allows.
    pub fn num_distinct(&self) -> u128 {
        let operands: u128 = (self.min_digits..=self.max_digits)
            .map(|d| {
                let lo = if d == 1 { 0 } else { 10u128.pow(d - 1) };
                10u128.pow(d) - lo
            })
            .sum();
        operands * operands
    }

    fn draw_operand(&self, rng: &mut SplitMix64) -> u64 {
        let digits =
            rng.range_inclusive(u64::from(self.min_digits), u64::from(self.max_digits)) as u32;
        let lo = if digits == 1 {
            0
        } else {
            10u64.pow(digits - 1)
        };
        rng.range_inclusive(lo, 10u64.pow(digits) - 1)
    }

    /// `train + held_out` distinct problems from the seed; the held-out ones come first in the
    /// draw, and no training problem equals a held-out one or its commuted form.
    pub fn split(&self, train: usize, held_out: usize) -> Result<AdditionSplit, Error> {
        self.check()?;
        let wanted = (train + held_out) as u128;
        // Commuted pairs are excluded too, so ask for at most half the distinct pairs.
        if wanted * 2 > self.num_distinct() {
            return Err(Error::Invalid {
                what: "problem count",
                reason: format!(
                    "{wanted} distinct problems asked for, but {}..={} digits allow only {} \
                     ordered pairs (at most half can be drawn without commuted repeats)",
                    self.min_digits,
                    self.max_digits,
                    self.num_distinct()
                ),
            });
        }
        let mut rng = SplitMix64::new(self.seed);
        let mut seen = HashSet::new();
        let mut draw = |n: usize, rng: &mut SplitMix64| {
            let mut out = Vec::with_capacity(n);
            while out.len() < n {
                let p = AdditionProblem {
                    a: self.draw_operand(rng),
                    b: self.draw_operand(rng),
                };
                if seen.insert((p.a, p.b)) {
                    seen.insert((p.b, p.a));
                    out.push(p);
                }
            }
            out
        };
        let held_out = draw(held_out, &mut rng);
        let train = draw(train, &mut rng);
        Ok(AdditionSplit { train, held_out })
    }
}

/// Writes problems as JSONL dataset lines ([`AdditionProblem::jsonl_value`]), creating the
/// parent folder.
pub fn write_jsonl(path: &Path, problems: &[AdditionProblem]) -> Result<(), Error> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut out = std::io::BufWriter::new(file);
    for p in problems {
        writeln!(out, "{}", p.jsonl_value()).map_err(|e| Error::io(path, e))?;
    }
    out.flush().map_err(|e| Error::io(path, e))
}

/// The answer part of a response: the text after the last `</think>` (the whole text when
/// there is none), with `<|im_end|>` / `<|endoftext|>` and what follows them removed, trimmed.
pub fn extract_answer(response: &str) -> &str {
    let after_think = response
        .rfind("</think>")
        .map_or(response, |at| &response[at + "</think>".len()..]);
    let end = ["<|im_end|>", "<|endoftext|>"]
        .iter()
        .filter_map(|stop| after_think.find(stop))
        .min()
        .unwrap_or(after_think.len());
    after_think[..end].trim()
}

/// Scores a response against the label.
///
/// * 1.0 when [`extract_answer`] equals the label exactly;
/// * otherwise, with `partial_credit` on and an answer made only of digits:
///   `0.5 × (digits equal to the label's at the same place value, counted from the units) /
///   max(answer length, label length)` — a dense signal for a model that is learning to
///   carry;
/// * else 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AdditionReward {
    /// Give partial credit for digits in the right place (off: exact match only).
    pub partial_credit: bool,
}

impl AdditionReward {
    /// The score of `response` for the label `label`.
    pub fn score(&self, response: &str, label: &str) -> f64 {
        let answer = extract_answer(response);
        let label = label.trim();
        if answer == label {
            return 1.0;
        }
        if !self.partial_credit || answer.is_empty() || !answer.bytes().all(|b| b.is_ascii_digit())
        {
            return 0.0;
        }
        let same = answer
            .bytes()
            .rev()
            .zip(label.bytes().rev())
            .filter(|(x, y)| x == y)
            .count();
        0.5 * same as f64 / answer.len().max(label.len()) as f64
    }
}

#[async_trait]
impl RewardFn for AdditionReward {
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        let label = sample.label.as_deref().ok_or_else(|| {
            CoreError::Reward(format!(
                "sample {:?} has no label (the addition reward needs the sum)",
                sample.index
            ))
        })?;
        Ok(Reward::Scalar(self.score(&sample.response, label)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_rollout::DatasetKeys;
    use miles_rollout::load_jsonl;

    #[test]
    fn problems_are_seeded_in_range_and_disjoint() {
        let task = AdditionTask {
            min_digits: 1,
            max_digits: 3,
            seed: 42,
        };
        let a = task.split(500, 100).unwrap();
        assert_eq!(a, task.split(500, 100).unwrap());
        assert_ne!(
            a,
            AdditionTask { seed: 43, ..task }.split(500, 100).unwrap()
        );
        assert_eq!((a.train.len(), a.held_out.len()), (500, 100));
        let held: HashSet<(u64, u64)> = a.held_out.iter().map(|p| (p.a, p.b)).collect();
        for p in &a.train {
            assert!(!held.contains(&(p.a, p.b)) && !held.contains(&(p.b, p.a)));
            assert!(p.a <= 999 && p.b <= 999);
        }
        let mut distinct: Vec<_> = a.train.iter().chain(&a.held_out).collect();
        distinct.sort_by_key(|p| (p.a, p.b));
        distinct.dedup();
        assert_eq!(distinct.len(), 600);
        // Each digit count appears.
        for d in 1..=3u32 {
            let lo = if d == 1 { 0 } else { 10u64.pow(d - 1) };
            assert!(a.train.iter().any(|p| (lo..10u64.pow(d)).contains(&p.a)));
        }
    }

    #[test]
    fn impossible_requests_are_errors() {
        let one = AdditionTask {
            min_digits: 1,
            max_digits: 1,
            seed: 0,
        };
        assert_eq!(one.num_distinct(), 100);
        assert!(one.split(40, 10).is_ok());
        assert!(one.split(45, 10).is_err());
        assert!(
            AdditionTask {
                min_digits: 0,
                ..one
            }
            .split(1, 1)
            .is_err()
        );
        assert!(
            AdditionTask {
                min_digits: 3,
                max_digits: 2,
                seed: 0
            }
            .split(1, 1)
            .is_err()
        );
    }

    #[test]
    fn jsonl_is_what_miles_rollout_reads() {
        let dir = std::env::temp_dir().join(format!("miles-ex-add-{}", std::process::id()));
        let path = dir.join("train.jsonl");
        let problems = [
            AdditionProblem { a: 12, b: 35 },
            AdditionProblem { a: 99, b: 1 },
        ];
        write_jsonl(&path, &problems).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text.lines().next().unwrap(),
            r#"{"input":[{"role":"user","content":"12+35="}],"label":"47","metadata":{"a":12,"b":35}}"#
        );
        let records = load_jsonl(&path, &DatasetKeys::default()).unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(records[0], problems[0].prompt_record());
        assert_eq!(records[1].label.as_deref(), Some("100"));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn careless_answers_drop_every_carry() {
        let p = |a, b| AdditionProblem { a, b };
        assert_eq!(p(27, 15).answer_without_carries(), "32");
        assert_eq!(p(95, 17).answer_without_carries(), "2");
        assert_eq!(p(50, 50).answer_without_carries(), "0");
        assert_eq!(p(99, 1).answer_without_carries(), "90");
        assert_eq!(p(12, 35).answer_without_carries(), "47");
        for a in 0..100 {
            for b in 0..100 {
                let q = p(a, b);
                assert_eq!(
                    q.answer_without_carries() == q.answer(),
                    !q.has_carry(),
                    "{a}+{b}"
                );
            }
        }
    }

    #[test]
    fn carries_are_detected() {
        let p = |a, b| AdditionProblem { a, b };
        assert!(!p(12, 35).has_carry());
        assert!(p(27, 15).has_carry());
        assert!(p(5, 5).has_carry());
        assert!(!p(0, 9).has_carry());
        assert!(!p(81, 10).has_carry());
        assert!(p(91, 10).has_carry()); // the tens carry: 101
        assert!(!p(84, 15).has_carry());
        assert!(p(95, 15).has_carry());
        assert!(p(50, 60).has_carry());
        assert!(!p(4, 0).has_carry());
    }

    #[test]
    fn answers_are_extracted_and_scored() {
        assert_eq!(extract_answer(" 47 "), "47");
        assert_eq!(
            extract_answer("<think>\n4+7\n</think>\n\n47<|im_end|>"),
            "47"
        );
        assert_eq!(extract_answer("47<|endoftext|>junk"), "47");
        let exact = AdditionReward::default();
        assert_eq!(exact.score("47", "47"), 1.0);
        assert_eq!(exact.score("<think>\n\n</think>\n\n47", "47"), 1.0);
        assert_eq!(exact.score("46", "47"), 0.0);
        let partial = AdditionReward {
            partial_credit: true,
        };
        assert_eq!(partial.score("47", "47"), 1.0);
        assert_eq!(partial.score("46", "47"), 0.25); // tens right: 0.5 × 1/2
        assert_eq!(partial.score("147", "47"), 0.5 * 2.0 / 3.0);
        assert_eq!(partial.score("7", "107"), 0.5 / 3.0);
        assert_eq!(partial.score("4x", "47"), 0.0);
        assert_eq!(partial.score("", "47"), 0.0);
    }

    #[test]
    fn reward_fn_reads_label_and_response() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut sample = Sample {
            response: "47".into(),
            label: Some("47".into()),
            ..Sample::default()
        };
        let r = rt
            .block_on(AdditionReward::default().reward(&sample))
            .unwrap();
        assert_eq!(r, Reward::Scalar(1.0));
        sample.label = None;
        let err = rt
            .block_on(AdditionReward::default().reward(&sample))
            .unwrap_err();
        assert!(err.to_string().contains("no label"));
    }
}

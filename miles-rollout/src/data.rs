//! Prompt data: JSONL and Parquet datasets read as Miles' `--prompt-data`, epochs, seeded
//! shuffling, a resumable cursor and a buffer of returned groups (Miles' data source).
//!
//! [`load_dataset`] picks the format from the extension (`.jsonl`, `.json` as JSON Lines,
//! `.parquet`; anything else is an [`Error::DatasetFile`]) and maps each row to a
//! [`PromptRecord`] the way Miles' `Dataset` does:
//!
//! * **prompt** (`--input-key`, default `input`): a string, or a list of chat messages
//!   (Parquet: `list<struct<role, content, …>>`). Missing or null, another type, or a message
//!   with an unknown role is a bad row. String prompts stay text; the [`crate::ChatPromptEncoder`]
//!   wraps them in one user message when rendering, as `--apply-chat-template` does.
//! * **label** (`--label-key`): a string is kept; any other value (number, struct…) becomes its
//!   compact JSON text (`5`, `{"ground_truth":"5","style":"rule"}`); missing or null → `None`.
//! * **metadata** (`--metadata-key`): an object (Parquet struct or map), or a string holding a
//!   JSON object; missing, null or falsy (`""`, `0`, `[]`, `false`) → empty, as Miles'
//!   `data.get(key) or {}`.
//! * **tools** (`--tool-key`): a list, or a string holding a JSON list (Miles `json.loads` it);
//!   stored as `metadata["tools"]`; null is treated as absent.
//! * A key with dots (`reward_model.ground_truth`) is looked up as is first (Miles' plain
//!   lookup), then, if absent, as a path through nested objects — an extension of ours.
//!
//! A bad row is an [`Error::DatasetRow`] naming file, row and key; with
//! [`DatasetOptions::skip_bad_rows`] it is skipped and counted ([`SkippedRows`]). Rows are
//! bounded by [`DatasetOptions::max_row_bytes`] (16 MiB by default): a longer JSONL line is
//! refused without being read into memory.

use std::collections::VecDeque;
use std::io::BufReader;
use std::path::Path;

use miles_core::Sample;
use miles_core::rng::SplitMix64;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

mod parquet_rows;
mod read;

use read::{ReadError, RowSink, read_json_lines};

pub use read::{
    DEFAULT_MAX_ROW_BYTES, DatasetFormat, DatasetKeys, DatasetOptions, LoadedDataset,
    PromptDataPath, PromptRecord, REPORTED_BAD_ROWS, RowRange, SkippedRows,
};

/// Parses JSONL text (strict: the first bad line is an [`Error::DatasetRow`] with file
/// `<string>`). Blank lines are skipped.
pub fn parse_jsonl(text: &str, keys: &DatasetKeys) -> Result<Vec<PromptRecord>> {
    let options = DatasetOptions::with_keys(keys.clone());
    let file = Path::new("<string>");
    let mut sink = read::RowSink::new(file, &options, None);
    read::read_json_lines(text.as_bytes(), &mut sink).map_err(|e| match e {
        read::ReadError::Io(source) => Error::Io {
            path: file.to_path_buf(),
            source,
        },
        read::ReadError::Other(e) => e,
    })?;
    Ok(sink.finish().records)
}

/// Reads a JSONL dataset file (strict). [`load_dataset`] reads Parquet too and can skip bad
/// rows.
pub fn load_jsonl(path: &Path, keys: &DatasetKeys) -> Result<Vec<PromptRecord>> {
    let options = DatasetOptions::with_keys(keys.clone());
    Ok(load_dataset(&PromptDataPath::from(path), &options)?.records)
}

/// Where the data source is: saved in checkpoints so a resumed run continues with the next
/// prompt (Miles' `global_dataset_state_dict` fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DataCursor {
    /// Next prompt position within the current epoch's order.
    pub sample_offset: usize,
    /// Current epoch (the shuffle seed is `seed + epoch_id`).
    pub epoch_id: u64,
    /// Next group index to assign.
    pub sample_group_index: u64,
    /// Next sample index to assign.
    pub sample_index: u64,
}

/// Everything the data source must persist: its cursor and the groups waiting in its buffer
/// (recycled or partially generated samples).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DataSourceState {
    /// The cursor.
    pub cursor: DataCursor,
    /// Buffered groups, served before new prompts.
    pub buffer: Vec<Vec<Sample>>,
}

/// Serves groups of `n_samples_per_prompt` samples per prompt, epoch after epoch, serving
/// buffered (returned) groups first.
#[derive(Debug, Clone)]
pub struct DataSource {
    prompts: Vec<PromptRecord>,
    n_samples_per_prompt: usize,
    shuffle: bool,
    seed: u64,
    order: Vec<usize>,
    cursor: DataCursor,
    buffer: VecDeque<Vec<Sample>>,
}

impl DataSource {
    /// A data source over `prompts` (non-empty). With `shuffle`, each epoch's order is a
    /// permutation seeded by `seed + epoch_id` (`--rollout-shuffle`, `--rollout-seed`).
    pub fn new(
        prompts: Vec<PromptRecord>,
        n_samples_per_prompt: usize,
        shuffle: bool,
        seed: u64,
    ) -> Result<Self> {
        if prompts.is_empty() {
            return Err(Error::Config("the dataset has no prompts".into()));
        }
        if n_samples_per_prompt == 0 {
            return Err(Error::Config("n_samples_per_prompt must be >= 1".into()));
        }
        let mut source = Self {
            prompts,
            n_samples_per_prompt,
            shuffle,
            seed,
            order: Vec::new(),
            cursor: DataCursor::default(),
            buffer: VecDeque::new(),
        };
        source.order = source.epoch_order(0);
        Ok(source)
    }

    fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.prompts.len()).collect();
        if self.shuffle {
            shuffle(&mut order, self.seed.wrapping_add(epoch));
        }
        order
    }

    /// Samples per group.
    pub fn n_samples_per_prompt(&self) -> usize {
        self.n_samples_per_prompt
    }

    /// Number of prompts in the dataset.
    pub fn len(&self) -> usize {
        self.prompts.len()
    }

    /// Always false: a data source is never empty (checked at construction).
    pub fn is_empty(&self) -> bool {
        self.prompts.is_empty()
    }

    /// Groups waiting in the buffer.
    pub fn buffered_groups(&self) -> usize {
        self.buffer.len()
    }

    /// The next `n_groups` groups: buffered groups first, then fresh prompts (wrapping into the
    /// next epoch as needed), each as `n_samples_per_prompt` copies with increasing
    /// `group_index` / `index`.
    pub fn get_groups(&mut self, n_groups: usize) -> Vec<Vec<Sample>> {
        let mut out = Vec::with_capacity(n_groups);
        while out.len() < n_groups {
            if let Some(group) = self.buffer.pop_front() {
                out.push(group);
                continue;
            }
            if self.cursor.sample_offset >= self.order.len() {
                self.cursor.epoch_id += 1;
                self.cursor.sample_offset = 0;
                self.order = self.epoch_order(self.cursor.epoch_id);
            }
            let record = &self.prompts[self.order[self.cursor.sample_offset]];
            self.cursor.sample_offset += 1;
            let group_index = self.cursor.sample_group_index;
            self.cursor.sample_group_index += 1;
            let mut group = Vec::with_capacity(self.n_samples_per_prompt);
            for _ in 0..self.n_samples_per_prompt {
                let mut sample = record.to_sample();
                sample.group_index = Some(group_index);
                sample.index = Some(self.cursor.sample_index);
                self.cursor.sample_index += 1;
                group.push(sample);
            }
            out.push(group);
        }
        out
    }

    /// Returns groups to the buffer (recycled stale groups, partially generated groups). Per-turn
    /// siblings collapse to one sample per rollout first (see
    /// [`collapse_siblings`]). Each must then have `n_samples_per_prompt`
    /// samples; a wrong size is an error and nothing is added.
    pub fn add_groups(&mut self, groups: Vec<Vec<Sample>>) -> Result<()> {
        let groups: Vec<Vec<Sample>> = groups.into_iter().map(collapse_siblings).collect();
        if let Some(bad) = groups.iter().find(|g| g.len() != self.n_samples_per_prompt) {
            return Err(Error::Config(format!(
                "a returned group has {} samples, expected {}",
                bad.len(),
                self.n_samples_per_prompt
            )));
        }
        self.buffer.extend(groups);
        Ok(())
    }

    /// The state to checkpoint.
    pub fn state(&self) -> DataSourceState {
        DataSourceState {
            cursor: self.cursor,
            buffer: self.buffer.iter().cloned().collect(),
        }
    }

    /// Restores a checkpointed state (the dataset and settings must be the same).
    pub fn restore(&mut self, state: DataSourceState) -> Result<()> {
        if state.cursor.sample_offset > self.prompts.len() {
            return Err(Error::Config(format!(
                "checkpoint offset {} exceeds the {} prompts of the dataset",
                state.cursor.sample_offset,
                self.prompts.len()
            )));
        }
        self.order = self.epoch_order(state.cursor.epoch_id);
        self.cursor = state.cursor;
        self.buffer = state.buffer.into();
        Ok(())
    }
}

/// Reads a prompt dataset (JSONL or Parquet, by extension) into records.
///
/// Without [`DatasetOptions::skip_bad_rows`] the first bad row is an [`Error::DatasetRow`]
/// naming file, row and key; with it, bad rows are counted in [`LoadedDataset::skipped`].
/// A file that cannot be read as its format is an [`Error::DatasetFile`].
pub fn load_dataset(source: &PromptDataPath, options: &DatasetOptions) -> Result<LoadedDataset> {
    let path = source.path.as_path();
    let format = DatasetFormat::from_path(path)?;
    let mut sink = RowSink::new(path, options, source.rows);
    match format {
        DatasetFormat::JsonLines => {
            let file = std::fs::File::open(path).map_err(|e| Error::Io {
                path: path.to_path_buf(),
                source: e,
            })?;
            read_json_lines(BufReader::new(file), &mut sink).map_err(|e| match e {
                ReadError::Io(source) => Error::Io {
                    path: path.to_path_buf(),
                    source,
                },
                ReadError::Other(e) => e,
            })?;
        }
        DatasetFormat::Parquet => parquet_rows::read_parquet(path, &mut sink)?,
    }
    Ok(sink.finish())
}

/// A group as the data source serves it again: one sample per rollout. Per-turn siblings
/// (samples sharing a rollout id, `rollout_id` else `index`, see
/// `SampleGenerator::generate_samples`) collapse to their first sample; a group that had
/// siblings is reset to be generated again (its turns cannot be resumed). Groups without
/// siblings come back unchanged.
pub fn collapse_siblings(group: Vec<Sample>) -> Vec<Sample> {
    let mut seen: Vec<u64> = Vec::new();
    let mut had_siblings = false;
    let mut out: Vec<Sample> = Vec::with_capacity(group.len());
    for sample in group {
        if let Some(id) = sample.rollout_id() {
            if seen.contains(&id) {
                had_siblings = true;
                continue;
            }
            seen.push(id);
        }
        out.push(sample);
    }
    if had_siblings {
        out.iter_mut().for_each(Sample::reset_for_retry);
    }
    out
}

/// Fisher–Yates shuffle seeded by `seed` (indices by [`SplitMix64::below`]).
fn shuffle(items: &mut [usize], seed: u64) {
    let mut rng = SplitMix64::new(seed);
    for i in (1..items.len()).rev() {
        let j = rng.below(i + 1);
        items.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::Prompt;
    use miles_core::Role;

    const JSONL: &str = r#"{"input": "1+1=", "label": 2}
{"input": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "label": "hello", "metadata": {"source": "chat"}, "tools": [{"type": "function", "function": {"name": "f"}}]}

{"input": "3+4=", "label": "7"}
"#;

    #[test]
    fn parses_text_messages_labels_metadata_and_tools() {
        let records = parse_jsonl(JSONL, &DatasetKeys::default()).unwrap();
        assert_eq!(records.len(), 3);
        assert_eq!(records[0].prompt, Prompt::Text("1+1=".into()));
        assert_eq!(records[0].label.as_deref(), Some("2"));
        let Prompt::Messages(messages) = &records[1].prompt else {
            panic!("expected messages")
        };
        assert_eq!(messages[1].role, Role::User);
        assert_eq!(records[1].metadata["source"], "chat");
        assert_eq!(records[1].metadata["tools"][0]["function"]["name"], "f");
    }

    #[test]
    fn bad_lines_name_the_line() {
        let err = parse_jsonl("{\"input\": \"a\"}\n[1]\n", &DatasetKeys::default()).unwrap_err();
        assert!(matches!(&err, Error::DatasetRow(e) if e.row == 2), "{err}");
        let err = parse_jsonl("{\"question\": \"a\"}", &DatasetKeys::default()).unwrap_err();
        assert!(
            matches!(&err, Error::DatasetRow(e) if e.row == 1 && e.key.as_deref() == Some("input"))
        );
        let err = parse_jsonl("{\"input\": 5}", &DatasetKeys::default()).unwrap_err();
        assert!(
            err.to_string().contains("a string or a list of messages"),
            "{err}"
        );
        assert!(DataSource::new(Vec::new(), 2, false, 0).is_err());
    }

    #[test]
    fn groups_wrap_epochs_with_increasing_indices() {
        let records = parse_jsonl(JSONL, &DatasetKeys::default()).unwrap();
        let mut source = DataSource::new(records, 2, false, 0).unwrap();
        let groups = source.get_groups(4);
        assert_eq!(groups.len(), 4);
        assert_eq!(
            groups[3][0].prompt,
            Prompt::Text("1+1=".into()),
            "epoch wrapped"
        );
        let indices: Vec<_> = groups.iter().flatten().map(|s| s.index.unwrap()).collect();
        assert_eq!(indices, (0..8).collect::<Vec<_>>());
        assert_eq!(groups[2][1].group_index, Some(2));
        assert_eq!(source.state().cursor.epoch_id, 1);
    }

    #[test]
    fn shuffle_is_a_seeded_permutation_per_epoch() {
        let records: Vec<_> = (0..50)
            .map(|i| PromptRecord::text(format!("q{i}"), i.to_string()))
            .collect();
        let mut a = DataSource::new(records.clone(), 1, true, 7).unwrap();
        let mut b = DataSource::new(records.clone(), 1, true, 7).unwrap();
        let labels = |groups: Vec<Vec<Sample>>| -> Vec<String> {
            groups
                .into_iter()
                .map(|g| g[0].label.clone().unwrap())
                .collect()
        };
        let epoch0 = labels(a.get_groups(50));
        assert_eq!(epoch0, labels(b.get_groups(50)), "same seed, same order");
        let mut sorted = epoch0.clone();
        sorted.sort_by_key(|l| l.parse::<u32>().unwrap());
        assert_eq!(sorted, (0..50).map(|i| i.to_string()).collect::<Vec<_>>());
        assert_ne!(epoch0, (0..50).map(|i| i.to_string()).collect::<Vec<_>>());
        let epoch1 = labels(a.get_groups(50));
        assert_ne!(epoch0, epoch1, "each epoch reshuffles");
    }

    #[test]
    fn resume_continues_with_the_next_prompt_and_buffer() {
        let records: Vec<_> = (0..5)
            .map(|i| PromptRecord::text(format!("q{i}"), i.to_string()))
            .collect();
        let mut source = DataSource::new(records.clone(), 2, true, 3).unwrap();
        let first = source.get_groups(3);
        source.add_groups(vec![first[0].clone()]).unwrap();
        assert!(source.add_groups(vec![vec![Sample::default()]]).is_err());
        let saved = serde_json::to_string(&source.state()).unwrap();
        let expected_next = source.clone().get_groups(4);

        let mut resumed = DataSource::new(records, 2, true, 3).unwrap();
        resumed
            .restore(serde_json::from_str(&saved).unwrap())
            .unwrap();
        let next = resumed.get_groups(4);
        assert_eq!(next, expected_next);
        assert_eq!(next[0], first[0], "the buffered group is served first");
    }
}

//! The prefix cache: KV caches of finished and prefilled sequences kept for reuse.

use miles_bridge::KvCache;

use super::scheduler::Scheduler;

pub(super) struct PrefixEntry {
    pub(super) tokens: Vec<u32>,
    pub(super) cache: KvCache,
    pub(super) routing: Vec<i32>,
    pub(super) last_used: u64,
}

impl Scheduler {
    /// Longest cached prefix of `tokens` (at most `len − 1` when `keep_one`): the cache, its
    /// length and its routing rows.
    pub(super) fn lookup_prefix(
        &mut self,
        tokens: &[u32],
        keep_one: bool,
    ) -> (KvCache, usize, Vec<i32>) {
        let limit = if keep_one {
            tokens.len().saturating_sub(1)
        } else {
            tokens.len()
        };
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.prefix.iter().enumerate() {
            let common = e
                .tokens
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(limit);
            if common > 0 && best.is_none_or(|(_, c)| common > c) {
                best = Some((i, common));
            }
        }
        let Some((i, common)) = best else {
            return (KvCache::new(), 0, Vec::new());
        };
        self.clock += 1;
        let entry = &mut self.prefix[i];
        entry.last_used = self.clock;
        let cache = if common == entry.tokens.len() {
            entry.cache.clone()
        } else {
            entry.cache.truncate(common)
        };
        let routing =
            entry.routing[..(common * self.route_width).min(entry.routing.len())].to_vec();
        (cache, common, routing)
    }

    pub(super) fn insert_prefix(&mut self, tokens: Vec<u32>, cache: KvCache, routing: Vec<i32>) {
        let budget = self.config.prefix_cache_tokens;
        if budget == 0 || tokens.len() > budget || tokens.is_empty() {
            return;
        }
        // An entry that is a prefix of the new one is covered by it.
        self.prefix
            .retain(|e| !(e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
        if self.prefix.iter().any(|e| e.tokens.starts_with(&tokens)) {
            return;
        }
        self.clock += 1;
        self.prefix.push(PrefixEntry {
            tokens,
            cache,
            routing,
            last_used: self.clock,
        });
        while self.prefix.iter().map(|e| e.tokens.len()).sum::<usize>() > budget {
            let Some(oldest) = self
                .prefix
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.prefix.swap_remove(oldest);
        }
    }
}

//! A router over inference engines, itself an [`InferenceEngine`]: sticky by routing key
//! (`X-SMG-Routing-Key` / session), otherwise least outstanding requests; engines that fail
//! are taken out of rotation and re-admitted once a health check passes (after catching up
//! to the current weights); a request is retried on another engine only when that is safe.
//!
//! Engines may be in-process or remote: [`Router::over_http`] builds a router over SGLang
//! servers (the [`SglangEngine`] client, e.g. `miles serve` processes), and
//! [`Router::spawn_health_checker`] runs [`Router::check_health`] periodically, the way Miles'
//! router polls `/health` every `--rollout-health-check-interval` seconds.
//!
//! Weight updates, pause / resume, cache flushes, aborts and memory release / resume
//! (`release_memory_occupation`, Miles' `--offload-rollout`) reach every engine in rotation.
//!
//! With every engine out of rotation, a request (and a weight update, pause or resume) waits
//! up to [`Router::with_unavailable_wait`] for the health checker to re-admit one (an engine
//! restarted by its supervisor), then fails `Unavailable` naming the engines; without a wait
//! (the default) it fails at once.
//!
//! When is a retry safe? An engine error of kind `Unavailable` means the caller received
//! nothing: the engine refused the connection, or (over HTTP) the connection dropped before an
//! answer arrived. `/generate` does not stream, so a dropped connection delivers no partial
//! output; whatever the dead engine generated died with it, and the request is re-run from its
//! prompt on another engine. Any other failure after the engine took the request (an internal
//! error, a protocol violation) may hide generated tokens, so the request ends ABORTED.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use super::client::{SglangConfig, SglangEngine};
use miles_core::{
    EngineErrorKind, Error as CoreError, GenerateOutput, GenerateRequest, InferenceEngine,
    MemoryTag, NamedTensors, PauseMode, RequestId, Result as CoreResult, WeightVersion,
    async_trait,
};

/// Re-creates an engine that died (in-process engines); `None` for engines that come back
/// on their own (HTTP servers restarted by their supervisor) and are only health-checked.
pub type EngineFactory = Arc<dyn Fn() -> CoreResult<Arc<dyn InferenceEngine>> + Send + Sync>;

struct Slot {
    name: String,
    engine: RwLock<Arc<dyn InferenceEngine>>,
    factory: Option<EngineFactory>,
    healthy: AtomicBool,
    outstanding: AtomicUsize,
}

impl Slot {
    fn engine(&self) -> Arc<dyn InferenceEngine> {
        self.engine
            .read()
            .map(|e| e.clone())
            .unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }
}

/// The weights the fleet should hold, so a re-admitted engine can catch up.
#[derive(Clone)]
enum LatestWeights {
    None,
    Tensors(Arc<NamedTensors>, WeightVersion),
    Disk(PathBuf, WeightVersion),
}

/// Most routing keys the router remembers; past it the oldest key is forgotten (its next
/// request is placed by load again), so a client inventing keys cannot grow memory.
pub const MAX_ROUTING_KEYS: usize = 65_536;

/// Routing key → engine, bounded to `capacity` keys; the oldest key is evicted first.
struct Affinity {
    map: HashMap<String, usize>,
    order: VecDeque<String>,
    capacity: usize,
}

impl Affinity {
    fn new(capacity: usize) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    fn get(&self, key: &str) -> Option<usize> {
        self.map.get(key).copied()
    }

    fn insert(&mut self, key: &str, engine: usize) {
        if self.map.insert(key.to_owned(), engine).is_none() {
            self.order.push_back(key.to_owned());
            while self.map.len() > self.capacity {
                let Some(oldest) = self.order.pop_front() else {
                    break;
                };
                self.map.remove(&oldest);
            }
        }
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

/// Spreads requests over engines. See the module docs.
pub struct Router {
    slots: Vec<Arc<Slot>>,
    affinity: Mutex<Affinity>,
    latest: Mutex<LatestWeights>,
    paused: Mutex<Option<PauseMode>>,
    /// Held while the fleet's weights or pause state change and while an engine is brought
    /// to them and re-admitted, so a re-admitted engine never misses a change made meanwhile.
    fleet_state: tokio::sync::Mutex<()>,
    /// How long a call waits for an engine back in rotation when none is (zero: no wait).
    unavailable_wait: Duration,
}

/// Decrements a slot's outstanding count when a request ends, however it ends.
struct Outstanding(Arc<Slot>);

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Router {
    /// A router over named engines (all assumed healthy at first). An engine with a factory
    /// is re-created when it fails its health check.
    pub fn new(engines: Vec<(String, Arc<dyn InferenceEngine>, Option<EngineFactory>)>) -> Self {
        Self {
            slots: engines
                .into_iter()
                .map(|(name, engine, factory)| {
                    Arc::new(Slot {
                        name,
                        engine: RwLock::new(engine),
                        factory,
                        healthy: AtomicBool::new(true),
                        outstanding: AtomicUsize::new(0),
                    })
                })
                .collect(),
            affinity: Mutex::new(Affinity::new(MAX_ROUTING_KEYS)),
            latest: Mutex::new(LatestWeights::None),
            paused: Mutex::new(None),
            fleet_state: tokio::sync::Mutex::new(()),
            unavailable_wait: Duration::ZERO,
        }
    }

    /// This router waiting up to `wait` for an engine to come back into rotation (re-admitted
    /// by [`Router::check_health`], e.g. from [`Router::spawn_health_checker`]) when a request,
    /// weight update, pause or resume finds none, instead of failing at once.
    pub fn with_unavailable_wait(mut self, wait: Duration) -> Self {
        self.unavailable_wait = wait;
        self
    }

    /// Waits until an engine is in rotation, before `deadline` (whether one is); `false` at
    /// once once the deadline has passed, so a caller retrying on it is bounded by the deadline
    /// even when an engine keeps coming back and failing.
    async fn wait_for_rotation(&self, deadline: tokio::time::Instant) -> bool {
        loop {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return false;
            }
            if self.slots.iter().any(|s| s.healthy.load(Ordering::SeqCst)) {
                return true;
            }
            tokio::time::sleep((deadline - now).min(Duration::from_millis(50))).await;
        }
    }

    /// The `Unavailable` error of a call that found no engine in rotation.
    fn none_in_rotation(&self, what: &str) -> CoreError {
        let names: Vec<&str> = self.slots.iter().map(|s| s.name.as_str()).collect();
        let waited = if self.unavailable_wait.is_zero() {
            String::new()
        } else {
            format!(
                " after waiting {:.1} s",
                self.unavailable_wait.as_secs_f64()
            )
        };
        CoreError::engine(
            EngineErrorKind::Unavailable,
            format!(
                "{what}: no engine in rotation{waited} (engines: {})",
                names.join(", ")
            ),
        )
    }

    /// A router over SGLang-protocol servers at `urls` (named by their URL), each reached with
    /// miles-session's [`SglangEngine`] client configured by `configure` (timeouts, MoE layer
    /// count for routed experts, a shared directory for tensor weight updates). Servers come
    /// back on their own after a restart, so they have no factory: they are re-admitted when
    /// [`Router::check_health`] finds them healthy again.
    pub fn over_http(urls: &[String], configure: impl Fn(&mut SglangConfig)) -> Self {
        Self::new(
            urls.iter()
                .map(|url| {
                    let mut config = SglangConfig::new(url.as_str());
                    configure(&mut config);
                    let engine: Arc<dyn InferenceEngine> = Arc::new(SglangEngine::new(config));
                    (url.clone(), engine, None)
                })
                .collect(),
        )
    }

    /// Runs [`Router::check_health`] every `interval` on the current tokio runtime until the
    /// returned handle is aborted (or the router is dropped by everyone else).
    pub fn spawn_health_checker(
        self: &Arc<Self>,
        interval: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let router = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                let Some(router) = router.upgrade() else {
                    return;
                };
                router.check_health().await;
            }
        })
    }

    /// Names of the engines currently in rotation.
    pub fn healthy_engines(&self) -> Vec<String> {
        self.slots
            .iter()
            .filter(|s| s.healthy.load(Ordering::SeqCst))
            .map(|s| s.name.clone())
            .collect()
    }

    /// Number of routing keys currently remembered (at most [`MAX_ROUTING_KEYS`]).
    pub fn routing_keys(&self) -> usize {
        self.affinity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Outstanding requests per engine, in engine order.
    pub fn outstanding(&self) -> Vec<usize> {
        self.slots
            .iter()
            .map(|s| s.outstanding.load(Ordering::SeqCst))
            .collect()
    }

    fn pick(&self, routing_key: Option<&str>, exclude: &[usize]) -> Option<usize> {
        let usable =
            |i: &usize| self.slots[*i].healthy.load(Ordering::SeqCst) && !exclude.contains(i);
        if let Some(key) = routing_key {
            let mut affinity = self.affinity.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = affinity.get(key).filter(|i| usable(i)) {
                return Some(i);
            }
            let chosen = self.least_loaded(&usable)?;
            affinity.insert(key, chosen);
            return Some(chosen);
        }
        self.least_loaded(&usable)
    }

    fn least_loaded(&self, usable: &dyn Fn(&usize) -> bool) -> Option<usize> {
        (0..self.slots.len())
            .filter(|i| usable(i))
            .min_by_key(|&i| self.slots[i].outstanding.load(Ordering::SeqCst))
    }

    fn mark_unhealthy(&self, index: usize, reason: &str) {
        if self.slots[index].healthy.swap(false, Ordering::SeqCst) {
            tracing::warn!(engine = %self.slots[index].name, reason, "engine removed from rotation");
        }
    }

    /// Health-checks every engine out of rotation: re-creates it if it has a factory, checks
    /// health, brings it to the fleet's weights and pause state, then re-admits it. Engines in
    /// rotation that fail their health check are removed. Returns the engines now in rotation.
    pub async fn check_health(&self) -> Vec<String> {
        for (index, slot) in self.slots.iter().enumerate() {
            if slot.healthy.load(Ordering::SeqCst) {
                if let Err(error) = slot.engine().health().await {
                    self.mark_unhealthy(index, &error.to_string());
                }
                continue;
            }
            if let Err(error) = self.readmit(slot).await {
                tracing::info!(engine = %slot.name, %error, "engine still unavailable");
            }
        }
        self.healthy_engines()
    }

    async fn readmit(&self, slot: &Slot) -> CoreResult<()> {
        let engine = match &slot.factory {
            Some(factory) => factory()?,
            None => slot.engine(),
        };
        engine.health().await?;
        let _fleet_state = self.fleet_state.lock().await;
        let latest = self
            .latest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let current = engine.weight_version().await?;
        let caught_up = match latest {
            LatestWeights::Tensors(weights, version) if current != version => {
                engine.update_weights(&weights, version).await
            }
            LatestWeights::Disk(dir, version) if current != version => {
                engine.update_weights_from_disk(&dir, version).await
            }
            _ => Ok(()),
        };
        match caught_up {
            Ok(()) => {}
            // The engine is up but could not load these weights: it serves its own version
            // (samples carry it) and gets the next version with the rest of the fleet, rather
            // than being retried on a path it cannot load.
            Err(error) if is_load_failure(&error) => {
                tracing::warn!(engine = %slot.name, %error, "re-admitted on its own weights");
            }
            Err(error) => return Err(error),
        }
        let paused = *self.paused.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mode) = paused {
            engine.pause(mode).await?;
        }
        *slot.engine.write().unwrap_or_else(|p| p.into_inner()) = engine;
        slot.healthy.store(true, Ordering::SeqCst);
        tracing::info!(engine = %slot.name, "engine re-admitted");
        Ok(())
    }

    /// A fleet-wide change (weights, pause, resume): waits (up to the unavailable wait) for an
    /// engine in rotation, records the fleet's new state with `record` and sends `op` to every
    /// engine in rotation. When each of them failed and left the rotation, the state stays
    /// recorded and an engine re-admitted within a fresh wait is brought to it (re-admission
    /// applies the recorded weights and pause state): the change then succeeds.
    async fn change_fleet(&self, op: FleetOp<'_>, record: impl FnOnce(&Self)) -> CoreResult<()> {
        let wait = self.unavailable_wait;
        self.wait_for_rotation(tokio::time::Instant::now() + wait)
            .await;
        let result = {
            // Taken after the wait: re-admission takes it too.
            let _fleet_state = self.fleet_state.lock().await;
            record(self);
            self.broadcast(op).await
        };
        match result {
            Err(_) if !wait.is_zero() && self.healthy_engines().is_empty() => {
                if self
                    .wait_for_rotation(tokio::time::Instant::now() + wait)
                    .await
                {
                    Ok(())
                } else {
                    Err(self.none_in_rotation(op.name()))
                }
            }
            other => other,
        }
    }

    /// Runs `op` on every engine in rotation, **all at once** (a weight update to N engines
    /// takes the time of the slowest, not the sum), then judges each answer in slot order: an
    /// engine whose call fails is taken out of rotation (it catches up when re-admitted).
    /// Fails only if no engine succeeded.
    async fn broadcast(&self, op: FleetOp<'_>) -> CoreResult<()> {
        let mut succeeded = 0;
        let mut last_error = None;
        let targets: Vec<(usize, Arc<dyn InferenceEngine>)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| slot.healthy.load(Ordering::SeqCst))
            .map(|(index, slot)| (index, slot.engine()))
            .collect();
        let results = join_all(
            targets
                .iter()
                .map(|(_, engine)| op.apply(engine.as_ref()))
                .collect(),
        )
        .await;
        for ((index, _), result) in targets.iter().zip(results) {
            let (index, slot) = (*index, &self.slots[*index]);
            match result {
                Ok(()) => succeeded += 1,
                Err(error) if op.is_weight_update() && is_load_failure(&error) => {
                    // The engine answered that it cannot load these weights: it keeps serving
                    // its last good version (samples carry it, staleness control sees it) and
                    // is offered the next version like every other engine.
                    tracing::warn!(engine = %slot.name, %error, "weight update refused; engine keeps its version");
                    last_error = Some(error);
                }
                Err(error) => {
                    self.mark_unhealthy(index, &format!("{} failed: {error}", op.name()));
                    last_error = Some(error);
                }
            }
        }
        if succeeded == 0 {
            return Err(last_error.unwrap_or_else(|| self.none_in_rotation(op.name())));
        }
        Ok(())
    }
}

/// Polls every future of `futures` in the calling task until all are ready; their outputs in
/// order. (Engine calls borrow the operation's data, so they cannot be spawned.)
async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    use std::task::Poll;
    let mut futures: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(value) => *output = Some(value),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

/// An operation sent to every engine of the fleet.
#[derive(Clone, Copy)]
enum FleetOp<'a> {
    Update(&'a NamedTensors, WeightVersion),
    Disk(&'a Path, WeightVersion),
    Pause(PauseMode),
    Resume,
    Flush,
    Abort(&'a RequestId),
    AbortAll,
    Release(&'a [MemoryTag]),
    ResumeMemory(&'a [MemoryTag]),
}

/// The engine answered and could not load the weights (bad path, bad checkpoint, refused
/// version): it is alive and still holds its previous weights.
fn is_load_failure(error: &CoreError) -> bool {
    matches!(
        error,
        CoreError::Engine {
            kind: EngineErrorKind::WeightUpdate | EngineErrorKind::InvalidRequest,
            ..
        }
    )
}

impl FleetOp<'_> {
    fn is_weight_update(&self) -> bool {
        matches!(self, Self::Update(..) | Self::Disk(..))
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Update(..) => "update_weights",
            Self::Disk(..) => "update_weights_from_disk",
            Self::Pause(_) => "pause",
            Self::Resume => "resume",
            Self::Flush => "flush_cache",
            Self::Abort(_) => "abort",
            Self::AbortAll => "abort_all",
            Self::Release(_) => "release_memory_occupation",
            Self::ResumeMemory(_) => "resume_memory_occupation",
        }
    }

    async fn apply(self, engine: &dyn InferenceEngine) -> CoreResult<()> {
        match self {
            Self::Update(weights, version) => engine.update_weights(weights, version).await,
            Self::Disk(dir, version) => engine.update_weights_from_disk(dir, version).await,
            Self::Pause(mode) => engine.pause(mode).await,
            Self::Resume => engine.resume().await,
            Self::Flush => engine.flush_cache().await,
            Self::Abort(id) => engine.abort(id).await,
            Self::AbortAll => engine.abort_all().await,
            Self::Release(tags) => engine.release_memory_occupation(tags).await.map(drop),
            Self::ResumeMemory(tags) => engine.resume_memory_occupation(tags).await.map(drop),
        }
    }
}

#[async_trait]
impl InferenceEngine for Router {
    async fn generate(&self, request: GenerateRequest) -> CoreResult<GenerateOutput> {
        let mut tried = Vec::new();
        let deadline = tokio::time::Instant::now() + self.unavailable_wait;
        loop {
            let Some(index) = self.pick(request.routing_key.as_deref(), &tried) else {
                // Every engine is out of rotation (or was tried): wait, until the deadline,
                // for one to be re-admitted — a re-admitted engine that failed this request
                // before is tried again, it never took the request.
                if self.wait_for_rotation(deadline).await {
                    tried.clear();
                    continue;
                }
                return Err(
                    self.none_in_rotation(&format!("generate (tried {} engine(s))", tried.len()))
                );
            };
            let slot = self.slots[index].clone();
            slot.outstanding.fetch_add(1, Ordering::SeqCst);
            let _guard = Outstanding(slot.clone());
            match slot.engine().generate(request.clone()).await {
                Ok(output) => return Ok(output),
                Err(CoreError::Engine {
                    kind: EngineErrorKind::Unavailable,
                    message,
                }) => {
                    // The engine never took the request: safe to try another one.
                    self.mark_unhealthy(index, &message);
                    tried.push(index);
                }
                Err(CoreError::Engine {
                    kind: EngineErrorKind::InvalidRequest,
                    message,
                }) => {
                    return Err(CoreError::engine(EngineErrorKind::InvalidRequest, message));
                }
                Err(error) => {
                    // It may have generated tokens we will never see: not safe to retry.
                    self.mark_unhealthy(index, &error.to_string());
                    return Err(CoreError::engine(
                        EngineErrorKind::Aborted,
                        format!("engine {} failed mid-request: {error}", slot.name),
                    ));
                }
            }
        }
    }

    async fn update_weights(
        &self,
        weights: &NamedTensors,
        version: WeightVersion,
    ) -> CoreResult<()> {
        self.change_fleet(FleetOp::Update(weights, version), |router| {
            *router.latest.lock().unwrap_or_else(|p| p.into_inner()) =
                LatestWeights::Tensors(Arc::new(weights.clone()), version);
        })
        .await
    }

    async fn update_weights_from_disk(&self, dir: &Path, version: WeightVersion) -> CoreResult<()> {
        self.change_fleet(FleetOp::Disk(dir, version), |router| {
            *router.latest.lock().unwrap_or_else(|p| p.into_inner()) =
                LatestWeights::Disk(dir.to_path_buf(), version);
        })
        .await
    }

    async fn pause(&self, mode: PauseMode) -> CoreResult<()> {
        self.change_fleet(FleetOp::Pause(mode), |router| {
            *router.paused.lock().unwrap_or_else(|p| p.into_inner()) = Some(mode);
        })
        .await
    }

    async fn resume(&self) -> CoreResult<()> {
        self.change_fleet(FleetOp::Resume, |router| {
            *router.paused.lock().unwrap_or_else(|p| p.into_inner()) = None;
        })
        .await
    }

    async fn flush_cache(&self) -> CoreResult<()> {
        self.broadcast(FleetOp::Flush).await
    }

    async fn abort(&self, request_id: &RequestId) -> CoreResult<()> {
        self.broadcast(FleetOp::Abort(request_id)).await
    }

    async fn abort_all(&self) -> CoreResult<()> {
        self.broadcast(FleetOp::AbortAll).await
    }

    /// Every engine in rotation releases `tags`, all at once (an engine that fails leaves the
    /// rotation, as with a weight update); `Ok(true)` once one of them did. None did (every
    /// engine down or failing): `Ok(false)`, not an error: a dead engine holds no memory, and
    /// the run goes on to the push, which waits for an engine to come back.
    async fn release_memory_occupation(&self, tags: &[MemoryTag]) -> CoreResult<bool> {
        match self.broadcast(FleetOp::Release(tags)).await {
            Ok(()) => Ok(true),
            Err(error) => {
                tracing::warn!(%error, "no engine released its memory");
                Ok(false)
            }
        }
    }

    /// Every engine in rotation takes `tags` back, all at once, waiting (up to the unavailable
    /// wait) for one in rotation before and, when every engine failed it, after, as a weight
    /// update does: an engine that died mid-call and is re-admitted comes back holding its
    /// memory (a restarted server allocates it at start), so nothing is recorded for it.
    async fn resume_memory_occupation(&self, tags: &[MemoryTag]) -> CoreResult<bool> {
        self.change_fleet(FleetOp::ResumeMemory(tags), |_| {})
            .await
            .map(|()| true)
    }

    async fn health(&self) -> CoreResult<()> {
        if self.healthy_engines().is_empty() {
            return Err(CoreError::engine(
                EngineErrorKind::Unavailable,
                "no engine in rotation",
            ));
        }
        Ok(())
    }

    /// The newest version an engine in rotation holds. Engines that could not load an update
    /// serve an older one until the next update reaches them; every sample carries the
    /// version that produced it, so staleness control sees the difference.
    async fn weight_version(&self) -> CoreResult<WeightVersion> {
        let mut version: Option<WeightVersion> = None;
        for slot in self
            .slots
            .iter()
            .filter(|s| s.healthy.load(Ordering::SeqCst))
        {
            let v = slot.engine().weight_version().await?;
            version = Some(version.map_or(v, |seen| seen.max(v)));
        }
        version
            .ok_or_else(|| CoreError::engine(EngineErrorKind::Unavailable, "no engine in rotation"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_is_bounded_and_forgets_the_oldest_key_first() {
        let mut affinity = Affinity::new(3);
        for (i, key) in ["a", "b", "c", "d", "e"].into_iter().enumerate() {
            affinity.insert(key, i);
        }
        assert_eq!(affinity.len(), 3);
        assert_eq!(affinity.get("a"), None);
        assert_eq!(affinity.get("b"), None);
        assert_eq!(affinity.get("e"), Some(4));
        // Re-inserting a known key updates it in place and evicts nothing.
        affinity.insert("c", 9);
        assert_eq!(
            (affinity.len(), affinity.get("c"), affinity.get("d")),
            (3, Some(9), Some(3))
        );
        assert_eq!(affinity.order.len(), 3);
    }
}

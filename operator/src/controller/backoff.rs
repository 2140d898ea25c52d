//! Retrying failed reconciles: one policy shared by every controller.
//!
//! Each object (keyed by uid) has a count of consecutive failed reconciles; a success or a new
//! generation starts it again. The n-th failure waits `min(CAP, BASE·2^(n-1))`, jittered to
//! between half and all of it ("equal jitter": unlike full jitter it never retries at once, so
//! one broken object cannot spin; the random half still spreads objects that failed together).
//!
//! A failure is *permanent* when retrying the same request cannot succeed (the apiserver refused
//! it as invalid: 400, 405, 406, 413, 415, 422; or the spec cannot be encoded). It stalls the
//! object at once: `Stalled=True` with the apiserver's message and a Warning Event. Any other
//! failure is *transient* (5xx, 429, timeouts, connection errors, 409 conflicts, 404 of an object
//! that may appear, 401/403 that an RBAC or quota change heals) and stalls the object only after
//! [`STALL_AFTER`] consecutive failures. Either way the object keeps being retried with backoff,
//! as what refused it may change (an admission policy, a quota) without any event reaching the
//! controller.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Wait after the first failure.
pub const BASE: Duration = Duration::from_secs(1);
/// Longest wait between two attempts.
pub const CAP: Duration = Duration::from_secs(300);
/// Consecutive transient failures after which the object is reported stalled (about four
/// minutes of retries with [`BASE`]).
pub const STALL_AFTER: u32 = 8;
/// Condition and Event reason of a stall reported by this policy.
pub const REASON: &str = "ReconcileError";

/// Whether retrying the same request may succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Transient,
    Permanent,
}

/// The apiserver status codes of a request that will be refused again as it is.
const PERMANENT_CODES: [u16; 6] = [400, 405, 406, 413, 415, 422];

/// Classifies a Kubernetes client error (see the module doc for why each code is what it is).
pub fn classify(err: &kube::Error) -> Verdict {
    match err {
        kube::Error::Api(status) if PERMANENT_CODES.contains(&status.code) => Verdict::Permanent,
        _ => Verdict::Transient,
    }
}

/// The apiserver's own message for an API error, the error itself otherwise.
pub fn describe(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(status) if !status.message.is_empty() => status.message.clone(),
        other => other.to_string(),
    }
}

/// The waits of the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub base: Duration,
    pub cap: Duration,
    pub stall_after: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            base: BASE,
            cap: CAP,
            stall_after: STALL_AFTER,
        }
    }
}

impl Policy {
    /// The longest wait after failure number `attempt` (1-based): `min(cap, base·2^(attempt-1))`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.base
            .checked_mul(1u32 << doublings)
            .map_or(self.cap, |d| d.min(self.cap))
    }

    /// The wait after failure number `attempt`: uniform in `[ceiling/2, ceiling]`.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling(attempt);
        let half = ceiling / 2;
        let spread = u64::try_from((ceiling - half).as_millis()).unwrap_or(u64::MAX);
        half + Duration::from_millis(rng.random_range(0..=spread))
    }
}

/// One failed reconcile, as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    /// Consecutive failures of this object, this one included.
    pub attempts: u32,
    /// How long to wait before the next attempt.
    pub delay: Duration,
    /// Whether the object is to be reported stalled.
    pub stall: bool,
    /// Whether this failure is the first of its run to stall (for reports made once).
    pub first_stall: bool,
}

#[derive(Debug)]
struct Entry {
    generation: Option<i64>,
    attempts: u32,
    stalled: bool,
    delay: Duration,
    at: Instant,
}

#[derive(Debug)]
struct Inner {
    rng: StdRng,
    entries: HashMap<String, Entry>,
}

/// Per-object failure counts of one controller.
#[derive(Debug)]
pub struct Backoff {
    policy: Policy,
    inner: Mutex<Inner>,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new(Policy::default())
    }
}

impl Backoff {
    pub fn new(policy: Policy) -> Self {
        Self::with_rng(policy, StdRng::from_rng(&mut rand::rng()))
    }

    /// With a seeded generator, so the waits are reproducible.
    pub fn seeded(policy: Policy, seed: u64) -> Self {
        Self::with_rng(policy, StdRng::seed_from_u64(seed))
    }

    fn with_rng(policy: Policy, rng: StdRng) -> Self {
        Self {
            policy,
            inner: Mutex::new(Inner {
                rng,
                entries: HashMap::new(),
            }),
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a failed reconcile of object `key` at `generation`.
    pub fn failure(&self, key: &str, generation: Option<i64>, verdict: Verdict) -> Failure {
        let now = Instant::now();
        let policy = self.policy;
        let mut inner = self.lock();
        // Objects deleted while failing never succeed: forget what is older than any wait.
        let horizon = policy.cap.saturating_mul(2);
        inner
            .entries
            .retain(|_, e| now.saturating_duration_since(e.at) <= horizon);
        let (attempts, was_stalled) = match inner.entries.get(key) {
            Some(e) if e.generation == generation => (e.attempts.saturating_add(1), e.stalled),
            _ => (1, false),
        };
        let delay = policy.delay(attempts, &mut inner.rng);
        let stall = verdict == Verdict::Permanent || attempts >= policy.stall_after;
        inner.entries.insert(
            key.to_owned(),
            Entry {
                generation,
                attempts,
                stalled: stall || was_stalled,
                delay,
                at: now,
            },
        );
        Failure {
            attempts,
            delay,
            stall,
            first_stall: stall && !was_stalled,
        }
    }

    /// The wait after the last failure of `key` (the base wait if none is recorded).
    pub fn delay(&self, key: &str) -> Duration {
        self.lock()
            .entries
            .get(key)
            .map_or(self.policy.base, |e| e.delay)
    }

    /// Records how a reconcile of the object with `meta` ended: a success forgets its failures,
    /// an error counts as one (judged by `verdict`), which is returned.
    pub fn record<T, E>(
        &self,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        result: &Result<T, E>,
        verdict: impl FnOnce(&E) -> Verdict,
    ) -> Option<Failure> {
        let key = key(meta);
        match result {
            Ok(_) => {
                self.success(&key);
                None
            }
            Err(err) => Some(self.failure(&key, meta.generation, verdict(err))),
        }
    }

    /// A successful reconcile: the next failure of `key` is a first one again.
    pub fn success(&self, key: &str) {
        self.lock().entries.remove(key);
    }
}

/// The key of an object in a [`Backoff`]: its uid, or `namespace/name` without one.
pub fn key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    meta.uid.clone().unwrap_or_else(|| {
        format!(
            "{}/{}",
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn api(code: u16) -> kube::Error {
        kube::Error::Api(
            Status::failure(&format!("refused with {code}"), "Test")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn ceilings_double_from_the_base_up_to_the_cap() {
        let p = Policy::default();
        let secs: Vec<u64> = (1..=11).map(|n| p.ceiling(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(p.ceiling(u32::MAX), CAP);
        assert_eq!(p.ceiling(0), BASE);
    }

    #[test]
    fn delays_are_jittered_within_half_and_all_of_the_ceiling() {
        let p = Policy::default();
        let mut rng = StdRng::seed_from_u64(7);
        for attempt in 1..=12 {
            let ceiling = p.ceiling(attempt);
            let seen: Vec<Duration> = (0..200).map(|_| p.delay(attempt, &mut rng)).collect();
            assert!(seen.iter().all(|d| *d >= ceiling / 2 && *d <= ceiling));
            // Jittered: not one fixed value.
            assert!(seen.iter().any(|d| *d != seen[0]), "attempt {attempt}");
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_waits() {
        let waits = |seed| {
            let b = Backoff::seeded(Policy::default(), seed);
            (0..6)
                .map(|_| b.failure("uid", Some(1), Verdict::Transient).delay)
                .collect::<Vec<_>>()
        };
        assert_eq!(waits(3), waits(3));
        assert_ne!(waits(3), waits(4));
    }

    #[test]
    fn attempts_count_per_object_and_reset_on_success_or_new_generation() {
        let b = Backoff::seeded(Policy::default(), 1);
        let attempts = |key, generation| b.failure(key, generation, Verdict::Transient).attempts;
        assert_eq!(attempts("a", Some(1)), 1);
        assert_eq!(attempts("a", Some(1)), 2);
        assert_eq!(attempts("b", Some(1)), 1);
        assert_eq!(attempts("a", Some(1)), 3);
        assert_eq!(attempts("a", Some(2)), 1, "a new generation starts again");
        b.success("a");
        assert_eq!(attempts("a", Some(2)), 1, "a success starts again");
        assert_eq!(attempts("b", Some(1)), 2);
    }

    #[test]
    fn the_recorded_delay_is_the_last_failures() {
        let b = Backoff::seeded(Policy::default(), 2);
        assert_eq!(b.delay("x"), BASE);
        let mut last = Duration::ZERO;
        for _ in 0..5 {
            last = b.failure("x", None, Verdict::Transient).delay;
        }
        assert_eq!(b.delay("x"), last);
        assert!(last >= Duration::from_secs(8) && last <= Duration::from_secs(16));
    }

    #[test]
    fn permanent_failures_stall_at_once_and_transient_ones_after_the_limit() {
        let b = Backoff::seeded(Policy::default(), 5);
        let first = b.failure("p", Some(1), Verdict::Permanent);
        assert!(first.stall && first.first_stall);
        let again = b.failure("p", Some(1), Verdict::Permanent);
        assert!(again.stall && !again.first_stall);
        let stalls: Vec<bool> = (0..STALL_AFTER + 1)
            .map(|_| b.failure("t", Some(1), Verdict::Transient).stall)
            .collect();
        let first = stalls.iter().position(|s| *s);
        assert_eq!(first, Some(STALL_AFTER as usize - 1));
        assert!(stalls[STALL_AFTER as usize - 1..].iter().all(|s| *s));
        b.success("t");
        let fresh = b.failure("t", Some(1), Verdict::Permanent);
        assert!(fresh.first_stall, "a success ends the run");
    }

    #[test]
    fn invalid_requests_are_permanent_and_the_rest_transient() {
        for code in [400, 405, 406, 413, 415, 422] {
            assert_eq!(classify(&api(code)), Verdict::Permanent, "{code}");
        }
        for code in [401, 403, 404, 408, 409, 410, 429, 500, 502, 503, 504] {
            assert_eq!(classify(&api(code)), Verdict::Transient, "{code}");
        }
        let io = kube::Error::ReadEvents(std::io::Error::other("connection reset"));
        assert_eq!(classify(&io), Verdict::Transient);
    }

    #[test]
    fn the_apiserver_message_is_what_is_described() {
        assert_eq!(describe(&api(422)), "refused with 422");
        let io = kube::Error::ReadEvents(std::io::Error::other("connection reset"));
        assert!(describe(&io).contains("connection reset"));
    }
}

//! Who may read the authenticated metrics listener (`--metrics-addr`): the decision from a
//! request's credentials and from what the API server said about them (a TokenReview, then a
//! SubjectAccessReview for `get` on the path, as kube-rbac-proxy and controller-runtime's
//! metrics filter do), and a cache of those answers. Pure: the reviews themselves are
//! [`crate::k8s::review`].
//!
//! Decisions:
//! - Only `Authorization: Bearer <token>` is accepted (no client certificates, no basic auth).
//!   No or another kind of credentials: 401 with `WWW-Authenticate: Bearer`; a token the API
//!   server does not authenticate: 401; authenticated but not allowed `get` on the path: 403
//!   naming the user; the API server not answering: 503 (Prometheus retries at its next scrape).
//! - Answers are cached per token, as the kubelet caches webhook answers: allowed for 2 minutes,
//!   refused for 10 seconds, failures not at all. At most [`MAX_CACHED`] tokens are remembered
//!   (the oldest answer goes first), by their SHA-256, never the token itself, each answer's text
//!   cut to [`MAX_TEXT`] bytes: a client sending random tokens cannot grow the agent, and a dump
//!   of its memory holds no token.
//! - New tokens are reviewed at most [`REVIEWS_PER_SECOND`] a second (a burst of
//!   [`REVIEW_BURST`]): past that a request gets 503 without a review, so a flood of tokens
//!   cannot turn the agents into a load on the API server ([`ReviewBudget`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What the API server says about a token, for one path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Authenticated and allowed `get` on the path.
    Allowed { user: String },
    /// Not authenticated (invalid, expired, or meant for another audience); the API's reason.
    Unauthenticated { reason: String },
    /// Authenticated, not allowed.
    Forbidden { user: String },
    /// No answer (API unreachable, an error): not cached.
    Unavailable { reason: String },
}

/// How long an answer is reused.
pub const ALLOWED_TTL: Duration = Duration::from_secs(120);
pub const REFUSED_TTL: Duration = Duration::from_secs(10);
/// Most tokens whose answers are remembered.
pub const MAX_CACHED: usize = 1024;
/// Most bytes of a user name or a reason an answer keeps.
pub const MAX_TEXT: usize = 256;
/// New tokens reviewed per second at most, and at once.
pub const REVIEWS_PER_SECOND: f64 = 5.0;
pub const REVIEW_BURST: f64 = 20.0;

impl Verdict {
    /// HTTP status of the response.
    pub fn status(&self) -> u16 {
        match self {
            Verdict::Allowed { .. } => 200,
            Verdict::Unauthenticated { .. } => 401,
            Verdict::Forbidden { .. } => 403,
            Verdict::Unavailable { .. } => 503,
        }
    }

    /// The body of a refusal: says what is missing without echoing the token.
    pub fn message(&self, path: &str) -> String {
        match self {
            Verdict::Allowed { user } => format!("{user} may get {path}\n"),
            Verdict::Unauthenticated { .. } => "Unauthorized: a valid bearer token is needed\n".to_string(),
            Verdict::Forbidden { user } => format!("Forbidden: user {user:?} may not get {path}\n"),
            Verdict::Unavailable { .. } => {
                "cannot check credentials now (Kubernetes API unavailable)\n".to_string()
            }
        }
    }

    fn ttl(&self) -> Option<Duration> {
        match self {
            Verdict::Allowed { .. } => Some(ALLOWED_TTL),
            Verdict::Unauthenticated { .. } | Verdict::Forbidden { .. } => Some(REFUSED_TTL),
            Verdict::Unavailable { .. } => None,
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header value (scheme case-insensitive, as in
/// RFC 6750); `None` for anything else, an empty token included.
pub fn bearer_token(header: Option<&str>) -> Option<&str> {
    let (scheme, token) = header?.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Answers per (token's SHA-256, path), each valid until its time.
#[derive(Debug, Default)]
pub struct ReviewCache {
    entries: HashMap<([u8; 32], String), (Verdict, Instant)>,
}

fn digest(token: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// `text` cut to [`MAX_TEXT`] bytes (at a character boundary).
fn bounded(text: String) -> String {
    match text.len() > MAX_TEXT {
        true => crate::core::domain::cut(&text, MAX_TEXT).to_string() + "…",
        false => text,
    }
}

impl Verdict {
    /// The same answer with its texts cut to [`MAX_TEXT`].
    fn bounded(self) -> Verdict {
        match self {
            Verdict::Allowed { user } => Verdict::Allowed { user: bounded(user) },
            Verdict::Unauthenticated { reason } => Verdict::Unauthenticated { reason: bounded(reason) },
            Verdict::Forbidden { user } => Verdict::Forbidden { user: bounded(user) },
            Verdict::Unavailable { reason } => Verdict::Unavailable { reason: bounded(reason) },
        }
    }
}

impl ReviewCache {
    /// The cached answer for `token` on `path`, if still valid at `now`.
    pub fn get(&self, token: &str, path: &str, now: Instant) -> Option<Verdict> {
        let (verdict, until) = self.entries.get(&(digest(token), path.to_string()))?;
        (now < *until).then(|| verdict.clone())
    }

    /// Remembers an answer (failures are not remembered); drops expired answers, then the
    /// oldest, to stay within [`MAX_CACHED`].
    pub fn put(&mut self, token: &str, path: &str, verdict: Verdict, now: Instant) {
        let Some(ttl) = verdict.ttl() else { return };
        if self.entries.len() >= MAX_CACHED {
            self.entries.retain(|_, (_, until)| now < *until);
        }
        while self.entries.len() >= MAX_CACHED {
            let oldest = self.entries.iter().min_by_key(|(_, (_, until))| *until).map(|(k, _)| k.clone());
            match oldest {
                Some(k) => self.entries.remove(&k),
                None => break,
            };
        }
        self.entries.insert((digest(token), path.to_string()), (verdict.bounded(), now + ttl));
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// How many new tokens may be reviewed now: a bucket of [`REVIEW_BURST`], refilled at
/// [`REVIEWS_PER_SECOND`].
#[derive(Debug)]
pub struct ReviewBudget {
    left: f64,
    at: Option<Instant>,
}

impl Default for ReviewBudget {
    fn default() -> Self {
        ReviewBudget { left: REVIEW_BURST, at: None }
    }
}

impl ReviewBudget {
    /// Takes one review at `now` if one is left.
    pub fn take(&mut self, now: Instant) -> bool {
        if let Some(at) = self.at {
            let refill = now.saturating_duration_since(at).as_secs_f64() * REVIEWS_PER_SECOND;
            self.left = (self.left + refill).min(REVIEW_BURST);
        }
        self.at = Some(now);
        if self.left < 1.0 {
            return false;
        }
        self.left -= 1.0;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_review_budget_refills_and_never_exceeds_its_burst() {
        let mut b = ReviewBudget::default();
        let t0 = Instant::now();
        let burst = (0..100).filter(|_| b.take(t0)).count();
        assert_eq!(burst, REVIEW_BURST as usize);
        assert!(!b.take(t0 + Duration::from_millis(100)), "half a review refilled");
        assert!(b.take(t0 + Duration::from_millis(250)));
        let after_an_hour = (0..100).filter(|_| b.take(t0 + Duration::from_secs(3600))).count();
        assert_eq!(after_an_hour, REVIEW_BURST as usize, "the bucket holds its burst at most");
    }

    #[test]
    fn answers_are_kept_by_digest_with_their_texts_bounded() {
        let mut c = ReviewCache::default();
        let now = Instant::now();
        let user = "u".repeat(10_000);
        c.put("secret-token", "/metrics", Verdict::Allowed { user }, now);
        let kept = format!("{:?}", c.entries);
        assert!(!kept.contains("secret-token"), "the token is not kept: {kept}");
        match c.get("secret-token", "/metrics", now) {
            Some(Verdict::Allowed { user }) => assert!(user.len() <= MAX_TEXT + "…".len(), "{}", user.len()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bearer_tokens() {
        let cases = [
            (None, None),
            (Some("Bearer abc"), Some("abc")),
            (Some("bearer   abc  "), Some("abc")),
            (Some("BEARER abc"), Some("abc")),
            (Some("Bearer "), None),
            (Some("Bearer"), None),
            (Some("Basic dXNlcjpwYXNz"), None),
            (Some("abc"), None),
            (Some(""), None),
        ];
        for (header, want) in cases {
            assert_eq!(bearer_token(header), want, "{header:?}");
        }
    }

    #[test]
    fn statuses_and_messages_never_echo_the_token() {
        let cases = [
            (Verdict::Allowed { user: "system:serviceaccount:monitoring:prometheus".into() }, 200),
            (Verdict::Unauthenticated { reason: "invalid bearer token secret".into() }, 401),
            (Verdict::Forbidden { user: "alice".into() }, 403),
            (Verdict::Unavailable { reason: "connection refused secret".into() }, 503),
        ];
        for (v, code) in cases {
            assert_eq!(v.status(), code, "{v:?}");
            assert!(!v.message("/metrics").contains("secret"), "{v:?}");
        }
        assert_eq!(
            Verdict::Forbidden { user: "alice".into() }.message("/metrics"),
            "Forbidden: user \"alice\" may not get /metrics\n"
        );
    }

    #[test]
    fn cache_keeps_answers_for_their_time_and_stays_bounded() {
        let t0 = Instant::now();
        let mut c = ReviewCache::default();
        let ok = Verdict::Allowed { user: "p".into() };
        let no = Verdict::Forbidden { user: "q".into() };
        c.put("a", "/metrics", ok.clone(), t0);
        c.put("b", "/metrics", no.clone(), t0);
        c.put("c", "/metrics", Verdict::Unavailable { reason: "down".into() }, t0);
        assert_eq!(c.get("a", "/metrics", t0 + ALLOWED_TTL - Duration::from_secs(1)), Some(ok));
        assert_eq!(c.get("a", "/metrics", t0 + ALLOWED_TTL), None);
        assert_eq!(c.get("a", "/other", t0), None, "per path");
        assert_eq!(c.get("b", "/metrics", t0 + REFUSED_TTL - Duration::from_secs(1)), Some(no));
        assert_eq!(c.get("b", "/metrics", t0 + REFUSED_TTL), None);
        assert_eq!(c.get("c", "/metrics", t0), None, "failures are not cached");
        for i in 0..3 * MAX_CACHED {
            c.put(&format!("t{i}"), "/metrics", Verdict::Unauthenticated { reason: String::new() }, t0);
        }
        assert_eq!(c.len(), MAX_CACHED);
        assert!(c.get(&format!("t{}", 3 * MAX_CACHED - 1), "/metrics", t0).is_some(), "the newest is kept");
    }
}

//! Kubernetes `Status` errors (`kind: Status`, `status: Failure`), as the real API server sends them.

use serde_json::{Value, json};

use crate::resources::ResourceType;

/// A failed API call, rendered over HTTP as a `metav1.Status` body with the same HTTP code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub code: u16,
    /// `StatusReason`: `NotFound`, `AlreadyExists`, `Conflict`, `Gone`, `Expired`, `Invalid`, `BadRequest`, ...
    pub reason: String,
    pub message: String,
    /// `details.name`, `details.group`, `details.kind` (the resource plural, like the real server).
    pub details: Option<Box<(String, String, String)>>,
    /// Sent as `Retry-After` and `details.retryAfterSeconds`.
    pub retry_after_seconds: Option<u32>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.reason, self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

impl ApiError {
    pub fn new(code: u16, reason: &str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason: reason.to_string(),
            message: message.into(),
            details: None,
            retry_after_seconds: None,
        }
    }

    fn with_details(mut self, rt: &ResourceType, name: &str) -> Self {
        self.details = Some(Box::new((name.to_string(), rt.group.to_string(), rt.plural.to_string())));
        self
    }

    fn qualified(rt: &ResourceType) -> String {
        if rt.group.is_empty() { rt.plural.to_string() } else { format!("{}.{}", rt.plural, rt.group) }
    }

    pub fn not_found(rt: &ResourceType, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{} \"{}\" not found", Self::qualified(rt), name))
            .with_details(rt, name)
    }

    pub fn already_exists(rt: &ResourceType, name: &str) -> Self {
        Self::new(409, "AlreadyExists", format!("{} \"{}\" already exists", Self::qualified(rt), name))
            .with_details(rt, name)
    }

    pub fn conflict(rt: &ResourceType, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {} \"{}\": {}", Self::qualified(rt), name, why),
        )
        .with_details(rt, name)
    }

    pub fn stale(rt: &ResourceType, name: &str) -> Self {
        Self::conflict(
            rt,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    pub fn invalid(rt: &ResourceType, name: &str, why: &str) -> Self {
        Self::new(
            422,
            "Invalid",
            format!("{}{} \"{}\" is invalid: {}", rt.kind, rt.dotted_group(), name, why),
        )
        .with_details(rt, name)
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    pub fn method_not_allowed() -> Self {
        Self::new(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
    }

    pub fn not_found_path() -> Self {
        Self::new(404, "NotFound", "the server could not find the requested resource")
    }

    pub fn unsupported_media_type(ct: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got {ct})"
            ),
        )
    }

    /// An injected failure (see `TestApiServer::fail_next`), with the reason the real server uses for the code.
    pub fn injected(code: u16) -> Self {
        let reason = match code {
            429 => "TooManyRequests",
            500 => "InternalError",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            409 => "Conflict",
            410 => "Gone",
            403 => "Forbidden",
            401 => "Unauthorized",
            404 => "NotFound",
            _ => "Unknown",
        };
        let mut e = Self::new(code, reason, format!("injected failure ({code}) by the test API server"));
        if code == 429 {
            e.message = "Too many requests, please try again later.".into();
            e.retry_after_seconds = Some(1);
        }
        e
    }

    /// The `metav1.Status` object.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        let mut details = serde_json::Map::new();
        if let Some((name, group, kind)) = self.details.as_deref() {
            details.insert("name".into(), json!(name));
            if !group.is_empty() {
                details.insert("group".into(), json!(group));
            }
            details.insert("kind".into(), json!(kind));
        }
        if let Some(r) = self.retry_after_seconds {
            details.insert("retryAfterSeconds".into(), json!(r));
        }
        if !details.is_empty() {
            s["details"] = Value::Object(details);
        }
        s
    }
}

impl ResourceType {
    fn dotted_group(&self) -> String {
        if self.group.is_empty() { String::new() } else { format!(".{}", self.group) }
    }
}

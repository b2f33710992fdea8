//! PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902), strategic merge patch (as merge
//! patch) and server-side apply (as merge patch of the applied configuration).

use serde_json::Value;

use crate::error::ApiError;
use crate::store::PatchOutcome;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PatchKind {
    Merge,
    Json,
    Strategic,
    Apply,
}

impl PatchKind {
    pub fn from_content_type(ct: &str) -> Option<Self> {
        match ct.split(';').next().unwrap_or("").trim() {
            "application/merge-patch+json" => Some(PatchKind::Merge),
            "application/json-patch+json" => Some(PatchKind::Json),
            "application/strategic-merge-patch+json" => Some(PatchKind::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+cbor" => Some(PatchKind::Apply),
            _ => None,
        }
    }
}

fn decode_err(e: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(format!("error decoding patch: {e}"))
}

/// Compute the patched object from the current one (`None`: the object does not exist).
pub(crate) fn apply(kind: PatchKind, current: Option<&Value>, body: &[u8]) -> Result<PatchOutcome, ApiError> {
    match kind {
        PatchKind::Apply => {
            let applied: Value = serde_yaml::from_slice(body).map_err(decode_err)?;
            if !applied.is_object() {
                return Err(ApiError::bad_request("apply patch must be an object"));
            }
            if applied.get("apiVersion").and_then(Value::as_str).is_none_or(str::is_empty)
                || applied.get("kind").and_then(Value::as_str).is_none_or(str::is_empty)
            {
                return Err(ApiError::bad_request(
                    "invalid object type: apiVersion and kind must be set in an apply patch",
                ));
            }
            let _ = current;
            Ok(PatchOutcome::Apply(applied))
        }
        PatchKind::Merge | PatchKind::Strategic => {
            let p: Value = serde_json::from_slice(body).map_err(decode_err)?;
            let Some(cur) = current else { return Ok(PatchOutcome::Update(Value::Null)) };
            let mut out = cur.clone();
            json_patch::merge(&mut out, &p);
            Ok(PatchOutcome::Update(out))
        }
        PatchKind::Json => {
            let p: json_patch::Patch = serde_json::from_slice(body).map_err(decode_err)?;
            let Some(cur) = current else { return Ok(PatchOutcome::Update(Value::Null)) };
            let mut out = cur.clone();
            json_patch::patch(&mut out, &p).map_err(|e| {
                ApiError::new(
                    422,
                    "Invalid",
                    format!("the server rejected our request due to an error in our request: {e}"),
                )
            })?;
            Ok(PatchOutcome::Update(out))
        }
    }
}

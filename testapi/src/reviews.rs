//! `authentication.k8s.io/v1` TokenReview and `authorization.k8s.io/v1` SubjectAccessReview:
//! create-only, answered from tokens and non-resource grants a test registers
//! ([`crate::TestApiServer::add_token`], [`crate::TestApiServer::grant_non_resource`]), not from
//! real authentication or RBAC. A token nobody registered is not authenticated; a subject is
//! allowed what was granted to its user name or to one of its groups, nothing else. The reviews
//! themselves are not authorized (the real server requires `create` on them: the tests check the
//! agents' requests against their RBAC from the request log).

use std::collections::{BTreeSet, HashMap};

use serde_json::{Value, json};

use crate::error::ApiError;

#[derive(Debug, Default)]
pub(crate) struct Reviews {
    /// token → (username, groups)
    tokens: HashMap<String, (String, Vec<String>)>,
    /// (user or group, verb, non-resource path)
    grants: BTreeSet<(String, String, String)>,
}

impl Reviews {
    pub fn add_token(&mut self, token: &str, user: &str, groups: &[&str]) {
        self.tokens
            .insert(token.to_string(), (user.to_string(), groups.iter().map(|g| g.to_string()).collect()));
    }

    pub fn grant(&mut self, subject: &str, verb: &str, path: &str) {
        self.grants.insert((subject.to_string(), verb.to_string(), path.to_string()));
    }

    /// The answer to a POST on `path`, when it is one of the two review resources.
    pub fn answer(&self, path: &str, body: &Value) -> Option<Result<Value, ApiError>> {
        match path.trim_end_matches('/') {
            "/apis/authentication.k8s.io/v1/tokenreviews" => Some(Ok(self.token_review(body))),
            "/apis/authorization.k8s.io/v1/subjectaccessreviews" => Some(self.access_review(body)),
            _ => None,
        }
    }

    fn token_review(&self, body: &Value) -> Value {
        let token = body["spec"]["token"].as_str().unwrap_or("");
        let status = match self.tokens.get(token) {
            Some((user, groups)) => json!({
                "authenticated": true,
                "user": {"username": user, "uid": format!("uid-{user}"), "groups": groups},
            }),
            None => json!({"user": {}, "error": "[invalid bearer token, token lookup failed]"}),
        };
        json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
               "metadata": {"creationTimestamp": null}, "spec": body["spec"], "status": status})
    }

    fn access_review(&self, body: &Value) -> Result<Value, ApiError> {
        let spec = &body["spec"];
        let Some(attrs) = spec.get("nonResourceAttributes") else {
            return Err(ApiError::bad_request("only nonResourceAttributes are answered by this test double"));
        };
        let (verb, path) = (attrs["verb"].as_str().unwrap_or(""), attrs["path"].as_str().unwrap_or(""));
        let mut subjects: Vec<&str> =
            spec["groups"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        subjects.extend(spec["user"].as_str());
        let allowed = subjects
            .iter()
            .any(|s| self.grants.contains(&(s.to_string(), verb.to_string(), path.to_string())));
        let status = if allowed {
            json!({"allowed": true, "reason": "granted by the test"})
        } else {
            json!({"allowed": false})
        };
        Ok(json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "metadata": {"creationTimestamp": null}, "spec": spec, "status": status}))
    }
}

//! Asking the API server about a bearer token: a TokenReview (who is it?), then a
//! SubjectAccessReview (may they `get` this path?), as kube-rbac-proxy does for the metrics of
//! MetalLB and kube-state-metrics, and controller-runtime's `WithAuthenticationAndAuthorization`.
//! The agent's ServiceAccount needs `create` on both (daemonset/10-rbac.yaml); the scraper needs
//! a role allowing `get` on the non-resource URL `/metrics` (`nodelb-metrics-reader`).
//! [`KubeReviewer::review`] is the edge; [`access_review`] and [`verdict`] are pure.

use futures::future::BoxFuture;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus, UserInfo};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec, SubjectAccessReviewStatus,
};
use kube::api::PostParams;
use kube::{Api, Client};

use crate::serve::access::Verdict;

#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("TokenReview: {0}")]
    TokenReview(kube::Error),
    #[error("SubjectAccessReview: {0}")]
    AccessReview(kube::Error),
}

/// Answers "may the holder of this token `get` this path?".
pub trait Reviewer: Send + Sync + 'static {
    fn review<'a>(&'a self, token: &'a str, path: &'a str) -> BoxFuture<'a, Verdict>;
}

/// The request asking whether `user` may `get` the non-resource URL `path`.
pub fn access_review(user: &UserInfo, path: &str) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username.clone(),
            uid: user.uid.clone(),
            groups: user.groups.clone(),
            extra: user.extra.clone(),
            non_resource_attributes: Some(NonResourceAttributes {
                path: Some(path.to_string()),
                verb: Some("get".to_string()),
            }),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The verdict from the TokenReview's status and, when it authenticated someone, the
/// SubjectAccessReview's.
pub fn verdict(token: &TokenReviewStatus, access: Option<&SubjectAccessReviewStatus>) -> Verdict {
    let user = token.user.as_ref().and_then(|u| u.username.clone()).unwrap_or_default();
    if token.authenticated != Some(true) || user.is_empty() {
        let reason = token.error.clone().unwrap_or_else(|| "not authenticated".to_string());
        return Verdict::Unauthenticated { reason };
    }
    match access {
        Some(a) if a.allowed && a.denied != Some(true) => Verdict::Allowed { user },
        _ => Verdict::Forbidden { user },
    }
}

/// Reviews through the agent's own client (its ServiceAccount).
#[derive(Clone)]
pub struct KubeReviewer {
    client: Client,
    /// What a token must be meant for (empty: the API server's own audiences).
    audiences: Vec<String>,
}

impl KubeReviewer {
    pub fn new(client: Client, audiences: Vec<String>) -> KubeReviewer {
        KubeReviewer { client, audiences }
    }

    async fn ask(&self, token: &str, path: &str) -> Result<Verdict, ReviewError> {
        let audiences = (!self.audiences.is_empty()).then(|| self.audiences.clone());
        let review = TokenReview {
            spec: TokenReviewSpec { token: token.to_string(), audiences },
            ..Default::default()
        };
        let pp = PostParams::default();
        let answer = Api::<TokenReview>::all(self.client.clone())
            .create(&pp, &review)
            .await
            .map_err(ReviewError::TokenReview)?;
        let status = answer.status.unwrap_or_default();
        let Some(user) = status.user.as_ref().filter(|_| status.authenticated == Some(true)) else {
            return Ok(verdict(&status, None));
        };
        let access = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&pp, &access_review(user, path))
            .await
            .map_err(ReviewError::AccessReview)?;
        Ok(verdict(&status, access.status.as_ref()))
    }
}

impl Reviewer for KubeReviewer {
    fn review<'a>(&'a self, token: &'a str, path: &'a str) -> BoxFuture<'a, Verdict> {
        Box::pin(async move {
            self.ask(token, path).await.unwrap_or_else(|e| Verdict::Unavailable { reason: e.to_string() })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(name: &str) -> UserInfo {
        UserInfo {
            username: Some(name.into()),
            uid: Some("u-1".into()),
            groups: Some(vec!["system:serviceaccounts".into()]),
            extra: None,
        }
    }

    #[test]
    fn the_access_review_asks_for_get_on_the_path_as_the_token_s_user() {
        let sar = access_review(&user("system:serviceaccount:monitoring:prometheus"), "/metrics");
        let v = serde_json::to_value(&sar).expect("json");
        assert_eq!(v["spec"]["user"], "system:serviceaccount:monitoring:prometheus");
        assert_eq!(v["spec"]["uid"], "u-1");
        assert_eq!(v["spec"]["groups"][0], "system:serviceaccounts");
        assert_eq!(
            v["spec"]["nonResourceAttributes"],
            serde_json::json!({"path": "/metrics", "verb": "get"})
        );
        assert!(v["spec"].get("resourceAttributes").is_none());
    }

    #[test]
    fn verdicts() {
        let authenticated =
            TokenReviewStatus { authenticated: Some(true), user: Some(user("p")), ..Default::default() };
        let allowed = SubjectAccessReviewStatus { allowed: true, ..Default::default() };
        let denied = SubjectAccessReviewStatus { allowed: false, ..Default::default() };
        let explicit_deny =
            SubjectAccessReviewStatus { allowed: true, denied: Some(true), ..Default::default() };
        let failed = TokenReviewStatus { error: Some("invalid bearer token".into()), ..Default::default() };
        let nobody = TokenReviewStatus {
            authenticated: Some(true),
            user: Some(UserInfo::default()),
            ..Default::default()
        };
        let cases = [
            (&authenticated, Some(&allowed), Verdict::Allowed { user: "p".into() }),
            (&authenticated, Some(&denied), Verdict::Forbidden { user: "p".into() }),
            (&authenticated, Some(&explicit_deny), Verdict::Forbidden { user: "p".into() }),
            (&authenticated, None, Verdict::Forbidden { user: "p".into() }),
            (&failed, Some(&allowed), Verdict::Unauthenticated { reason: "invalid bearer token".into() }),
            (&nobody, Some(&allowed), Verdict::Unauthenticated { reason: "not authenticated".into() }),
        ];
        for (token, access, want) in cases {
            assert_eq!(verdict(token, access), want, "{token:?} {access:?}");
        }
    }
}

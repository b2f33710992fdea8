//! TokenReview and SubjectAccessReview through a real `kube::Client`: answered from the tokens and
//! non-resource grants the test registered, nothing else.

mod common;

use common::{client, server};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};

#[tokio::test]
async fn token_and_access_reviews_follow_what_the_test_registered() {
    let srv = server();
    srv.add_token("t-prom", "system:serviceaccount:monitoring:prometheus", &["system:serviceaccounts"]);
    srv.add_token("t-alice", "alice", &["dev"]);
    srv.grant_non_resource("system:serviceaccounts", "get", "/metrics");
    let c = client(&srv).await;
    let pp = PostParams::default();
    let review = |token: &str| TokenReview {
        spec: TokenReviewSpec { token: token.into(), audiences: None },
        ..Default::default()
    };
    let tr = Api::<TokenReview>::all(c.clone()).create(&pp, &review("t-prom")).await.expect("TokenReview");
    let st = tr.status.expect("status");
    assert_eq!(st.authenticated, Some(true));
    let user = st.user.expect("user");
    assert_eq!(user.username.as_deref(), Some("system:serviceaccount:monitoring:prometheus"));
    let st =
        Api::<TokenReview>::all(c.clone()).create(&pp, &review("forged")).await.expect("TokenReview").status;
    let st = st.expect("status");
    assert_ne!(st.authenticated, Some(true));
    assert!(st.error.is_some_and(|e| e.contains("invalid bearer token")));

    let ask = |user: &str, groups: &[&str], path: &str| SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.into()),
            groups: Some(groups.iter().map(|g| g.to_string()).collect()),
            non_resource_attributes: Some(NonResourceAttributes {
                path: Some(path.into()),
                verb: Some("get".into()),
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let sars = Api::<SubjectAccessReview>::all(c);
    let prom = ("system:serviceaccount:monitoring:prometheus", &["system:serviceaccounts"][..]);
    let cases =
        [(prom, "/metrics", true), (("alice", &["dev"][..]), "/metrics", false), (prom, "/status", false)];
    for ((user, groups), path, want) in cases {
        let st = sars.create(&pp, &ask(user, groups, path)).await.expect("SubjectAccessReview").status;
        assert_eq!(st.expect("status").allowed, want, "{user} get {path}");
    }
    let log = srv.requests();
    assert!(log.iter().any(|r| r.method == "POST"
        && r.path == "/apis/authentication.k8s.io/v1/tokenreviews"
        && r.status == 201));
}

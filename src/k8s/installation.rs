//! Watches what tells an uninstall from a restart (this agent's Namespace, DaemonSet and Node, each
//! by name) for the whole life of the agent, and at SIGTERM reads them once more and decides with
//! [`crate::core::k8s::uninstall::decide`]. The watches keep their last view through errors: after
//! `kubectl delete -f daemonset/` deleted the RBAC, an established watch still delivers the
//! Namespace's deletion, and a failed relist changes nothing.
//!
//! RBAC: list/watch of the Namespace and the DaemonSet restricted by `resourceNames` (every request
//! carries `fieldSelector=metadata.name=…`, which is how the authorizer applies names to list and
//! watch); the Node with the `list`/`watch` of nodes the Node reflector has anyway.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::ListParams;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use tracing::{debug, info, warn};

use crate::core::k8s::uninstall::{self, DaemonSetFacts, Exit, LastRead, NamespaceFacts, NodeFacts, Seen};
use crate::locks::lock;

/// How long the last read at SIGTERM may take: a few seconds of the pod's grace period (10 s in
/// the shipped DaemonSet), leaving the rest for removing the rules.
pub const LAST_READ_TIMEOUT: Duration = Duration::from_secs(3);

/// A read that did not answer with the objects.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("401 Unauthorized: {0}")]
    Unauthorized(String),
    #[error("403 Forbidden: {0}")]
    Forbidden(String),
    #[error("no answer: {0}")]
    Unavailable(String),
}

impl From<kube::Error> for ReadError {
    fn from(e: kube::Error) -> ReadError {
        match &e {
            kube::Error::Api(s) if s.code == 401 => ReadError::Unauthorized(s.message.clone()),
            kube::Error::Api(s) if s.code == 403 => ReadError::Forbidden(s.message.clone()),
            _ => ReadError::Unavailable(e.to_string()),
        }
    }
}

/// Whom to watch: `daemonset` in `namespace`, running on `node`.
#[derive(Debug, Clone)]
pub struct Installation {
    pub namespace: String,
    pub daemonset: String,
    pub node: String,
}

/// The running watches and what they saw last.
pub struct Tracker {
    client: Client,
    who: Installation,
    seen: Arc<Mutex<Seen>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn by_name(name: &str) -> String {
    format!("metadata.name={name}")
}

impl Tracker {
    /// Starts the three watches on the current Tokio runtime.
    pub fn start(client: Client, who: Installation) -> Tracker {
        let seen: Arc<Mutex<Seen>> = Arc::default();
        let tasks = vec![
            watch(Api::<Namespace>::all(client.clone()), &who.namespace, seen.clone(), |s, o| {
                s.namespace = o.map(NamespaceFacts::of).into()
            }),
            watch(
                Api::<DaemonSet>::namespaced(client.clone(), &who.namespace),
                &who.daemonset,
                seen.clone(),
                |s, o| s.daemonset = o.map(DaemonSetFacts::of).into(),
            ),
            watch(Api::<Node>::all(client.clone()), &who.node, seen.clone(), |s, o| {
                s.node = o.map(NodeFacts::of).into()
            }),
        ];
        info!(namespace = %who.namespace, daemonset = %who.daemonset, "watching the installation: rules are removed on exit when nodelb is uninstalled");
        Tracker { client, who, seen, tasks }
    }

    /// Stops the watches, reads the three objects once more (at most [`LAST_READ_TIMEOUT`]) and
    /// decides what happens to the node's rules.
    pub async fn decide_at_exit(self) -> Exit {
        for t in &self.tasks {
            t.abort();
        }
        let mut seen = lock(&self.seen).clone();
        let read = tokio::time::timeout(LAST_READ_TIMEOUT, self.last_read(&mut seen)).await;
        seen.last_read = match read {
            Ok(r) => r,
            Err(_) => LastRead::NoAnswer,
        };
        debug!(?seen, "installation at exit");
        uninstall::decide(&seen, &self.who.namespace, &self.who.daemonset)
    }

    /// One list of each object by name; what answers replaces what the watches saw.
    async fn last_read(&self, seen: &mut Seen) -> LastRead {
        let (ns, ds, node) = tokio::join!(
            read_one(Api::<Namespace>::all(self.client.clone()), &self.who.namespace),
            read_one(
                Api::<DaemonSet>::namespaced(self.client.clone(), &self.who.namespace),
                &self.who.daemonset
            ),
            read_one(Api::<Node>::all(self.client.clone()), &self.who.node),
        );
        let mut errors = Vec::new();
        match ns {
            Ok(o) => seen.namespace = o.as_ref().map(NamespaceFacts::of).into(),
            Err(e) => errors.push(e),
        }
        match ds {
            Ok(o) => seen.daemonset = o.as_ref().map(DaemonSetFacts::of).into(),
            Err(e) => errors.push(e),
        }
        match node {
            Ok(o) => seen.node = o.as_ref().map(NodeFacts::of).into(),
            Err(e) => errors.push(e),
        }
        for e in &errors {
            warn!(error = %e, "reading the installation at exit");
        }
        // One refusal of the credentials is decisive; a 403 only when nothing else answered.
        if let Some(ReadError::Unauthorized(m)) =
            errors.iter().find(|e| matches!(e, ReadError::Unauthorized(_)))
        {
            return LastRead::Unauthorized(m.clone());
        }
        match errors.first() {
            None => LastRead::Answered,
            Some(ReadError::Forbidden(m)) => LastRead::Forbidden(m.clone()),
            Some(_) => LastRead::NoAnswer,
        }
    }
}

async fn read_one<K>(api: Api<K>, name: &str) -> Result<Option<K>, ReadError>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let list = api.list(&ListParams::default().fields(&by_name(name))).await?;
    Ok(list.items.into_iter().next())
}

/// Watches the object called `name`; `set` records each change (`None`: absent).
fn watch<K>(
    api: Api<K>,
    name: &str,
    seen: Arc<Mutex<Seen>>,
    set: impl Fn(&mut Seen, Option<&K>) + Send + 'static,
) -> tokio::task::JoinHandle<()>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    let kind = std::any::type_name::<K>().rsplit("::").next().unwrap_or("object");
    let stream = watcher(api, watcher::Config::default().fields(&by_name(name))).default_backoff();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        // A relist's objects arrive between Init and InitDone; none at all means absent.
        let mut relisted = None;
        let mut failing = false;
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(watcher::Event::Init) => relisted = Some(None),
                Ok(watcher::Event::InitApply(o)) => relisted = Some(Some(o)),
                Ok(watcher::Event::InitDone) => {
                    let o = relisted.take().flatten();
                    set(&mut lock(&seen), o.as_ref());
                    failing = false;
                }
                Ok(watcher::Event::Apply(o)) => set(&mut lock(&seen), Some(&o)),
                Ok(watcher::Event::Delete(_)) => set(&mut lock(&seen), None),
                Err(e) => {
                    if !failing {
                        warn!(kind, error = %e, "installation watch failed; keeping its last view");
                        failing = true;
                    }
                }
            }
        }
    })
}

//! Tandem's Kubernetes executor: one agent-sandbox claim per task session, the runner over pod
//! exec.
//!
//! A session claims a pod from a `SandboxWarmPool` (`agents.x-k8s.io` agent-sandbox,
//! v1beta1) with a `SandboxClaim`, waits for the claim to be bound to a ready `Sandbox`, and
//! execs Tandem's runner in the sandbox's pod; every block then goes through that one exec
//! stream, as a Docker session's go through its attached container. The workspace lives in
//! the pod and is mirrored on this machine after every block; files go in and out as tar
//! streams through further execs. Deleting the claim deletes the sandbox; claims a dead
//! Tandem left behind are found by their labels and deleted at start.

mod session;
pub mod volumes;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};
use tandem_executor::{BoxFuture, ExecError, Executor, Language, Session, SessionSpec};
use tandem_executor_kit::owner;

/// The agent-sandbox core group (`Sandbox`).
pub const SANDBOX_GROUP: &str = "agents.x-k8s.io";
/// The agent-sandbox extensions group (`SandboxTemplate`, `SandboxWarmPool`, `SandboxClaim`).
pub const EXTENSIONS_GROUP: &str = "extensions.agents.x-k8s.io";
/// The agent-sandbox API version Tandem speaks.
pub const VERSION: &str = "v1beta1";

/// Labels and annotations Tandem puts on its claims.
pub mod labels {
    /// Marks a claim as Tandem's (label, value `tandem`).
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    /// The Tandem instance, as a label value.
    pub const DAEMON: &str = "tandem.dev/daemon";
    /// The session's id (label).
    pub const SESSION: &str = "tandem.dev/session";
    /// `host/pid:start-time` of the process that owns the claim (annotation: label values
    /// cannot hold it), to reap orphans.
    pub const OWNER: &str = "tandem.dev/owner";
    /// The task's id, when the session belongs to one (annotation).
    pub const TASK: &str = "tandem.dev/task";
    /// The Tandem volume a `PersistentVolumeClaim` holds (annotation); no reaper deletes one.
    pub const VOLUME: &str = "tandem.dev/volume";
    /// On a `Sandbox` Tandem made itself (a session with volumes), not through a claim
    /// (label, value `session`): what it deletes and reaps as it does claims.
    pub const MADE: &str = "tandem.dev/made";
}

/// How to reach the cluster and which warm pool to claim from.
#[derive(Clone, Debug)]
pub struct KubernetesConfig {
    /// The API server's URL; `None` reads `kubeconfig` (or `KUBECONFIG`, `~/.kube/config`, the
    /// in-cluster service account).
    pub url: Option<String>,
    /// A kubeconfig file to read instead of the default places.
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use (default: its current one).
    pub context: Option<String>,
    /// The namespace the claims are made in.
    pub namespace: String,
    /// The `SandboxWarmPool` every session is claimed from.
    pub warm_pool: String,
    /// The container in the sandbox's pod the runner is exec'd in (default: the pod's only
    /// or first one).
    pub container: Option<String>,
    /// The `uid:gid` blocks run as; the pod's own user when it already is not root.
    pub user: String,
    /// Languages the pod's image runs.
    pub languages: Vec<Language>,
    /// Extra environment for every block.
    pub env: Vec<(String, String)>,
    /// The Tandem instance, put on every claim.
    pub daemon_id: String,
    /// How long a claim may take to be bound to a ready sandbox.
    pub ready_timeout: Duration,
    /// Where workspace mirrors are made (default `$TMPDIR`).
    pub workspace_dir: Option<PathBuf>,
    /// The access mode of the claims Tandem makes for volumes (default `ReadWriteOnce`:
    /// pods sharing a volume at once must then run on one node).
    pub volume_access_mode: String,
    /// The storage class of those claims (default: the cluster's default class).
    pub volume_storage_class: Option<String>,
}

/// The access modes a volume's claim may ask for.
pub const VOLUME_ACCESS_MODES: [&str; 3] = ["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"];

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            url: None,
            kubeconfig: None,
            context: None,
            namespace: "tandem".to_owned(),
            warm_pool: "tandem".to_owned(),
            container: None,
            user: "65534:65534".to_owned(),
            languages: vec![Language::python(), Language::sh()],
            env: Vec::new(),
            daemon_id: format!("tandem-{}", std::process::id()),
            ready_timeout: Duration::from_secs(120),
            workspace_dir: None,
            volume_access_mode: "ReadWriteOnce".to_owned(),
            volume_storage_class: None,
        }
    }
}

impl KubernetesConfig {
    /// Where the API server is, for messages.
    pub fn label(&self) -> String {
        match (&self.url, &self.kubeconfig) {
            (Some(url), _) => url.clone(),
            (None, Some(file)) => format!("the cluster of {}", file.display()),
            (None, None) => "the cluster of the current kubeconfig".to_owned(),
        }
    }
}

/// Failures to reach the cluster or use its agent-sandbox resources.
#[derive(Debug, thiserror::Error)]
pub enum KubernetesError {
    /// The client could not be configured.
    #[error(
        "cannot configure the Kubernetes client: {0}; set [executors.kubernetes] url or kubeconfig"
    )]
    Config(String),
    /// The API server did not answer.
    #[error(
        "cannot reach the Kubernetes API at {url}: {reason}; check [executors.kubernetes] url (or the kubeconfig) and that the API server is up"
    )]
    Unreachable {
        /// Where Tandem looked.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// The warm pool is not there.
    #[error(
        "the SandboxWarmPool `{pool}` does not exist in namespace `{namespace}`; apply docs/deploy/kubernetes/ (kubectl apply -k, after the agent-sandbox controller) or set [executors.kubernetes] warm_pool"
    )]
    NoWarmPool {
        /// The pool asked for.
        pool: String,
        /// Where.
        namespace: String,
    },
    /// The cluster does not know the agent-sandbox resources.
    #[error(
        "the cluster does not serve {resource} ({group}/{VERSION}) in namespace `{namespace}`; install the agent-sandbox controller and its extensions, and create the namespace (docs/deploy/kubernetes/)"
    )]
    NoAgentSandbox {
        /// The resource's plural.
        resource: &'static str,
        /// Its group.
        group: &'static str,
        /// The namespace asked for.
        namespace: String,
    },
    /// The API server refused or failed a request.
    #[error("Kubernetes API: {what} failed: {reason}")]
    Api {
        /// What Tandem was doing.
        what: String,
        /// What the server said.
        reason: String,
    },
}

impl From<KubernetesError> for ExecError {
    fn from(e: KubernetesError) -> Self {
        match e {
            KubernetesError::Unreachable { .. } | KubernetesError::Config(_) => {
                ExecError::Unavailable {
                    what: "the kubernetes executor".to_owned(),
                    hint: e.to_string(),
                }
            }
            other => ExecError::Backend(other.to_string()),
        }
    }
}

/// How long one API request may take.
const REQUEST_LIMIT: Duration = Duration::from_secs(30);

/// Runs sessions as agent-sandbox claims on a Kubernetes cluster.
#[derive(Clone)]
pub struct KubernetesExecutor {
    inner: Arc<Inner>,
}

struct Inner {
    config: KubernetesConfig,
    client: kube::Client,
    /// The API server's address, for messages.
    url: String,
    owner: String,
    /// Where temporary mirrors go; a per-process directory, reaped by the next Tandem.
    root: PathBuf,
    /// Whether the executor is shut down; each claim's making holds it read until the
    /// server has answered, so that shutdown, which writes it, waits for them all and then
    /// finds every claim there is.
    closed: Arc<tokio::sync::RwLock<bool>>,
}

/// The `kind`'s resource in the agent-sandbox groups.
fn resource(group: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, VERSION, kind), plural)
}

/// The `SandboxClaim` resource.
pub fn claims_resource() -> ApiResource {
    resource(EXTENSIONS_GROUP, "SandboxClaim", "sandboxclaims")
}

/// The `SandboxWarmPool` resource.
pub fn warm_pools_resource() -> ApiResource {
    resource(EXTENSIONS_GROUP, "SandboxWarmPool", "sandboxwarmpools")
}

/// The `Sandbox` resource.
pub fn sandboxes_resource() -> ApiResource {
    resource(SANDBOX_GROUP, "Sandbox", "sandboxes")
}

/// The `SandboxTemplate` resource.
pub fn templates_resource() -> ApiResource {
    resource(EXTENSIONS_GROUP, "SandboxTemplate", "sandboxtemplates")
}

/// What a session holds on the cluster: a claim on the warm pool, or (a session with
/// volumes, which a pooled pod was started without) a `Sandbox` of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Held {
    Claim,
    Sandbox,
}

impl Held {
    /// Its API resource.
    fn resource(self) -> ApiResource {
        match self {
            Self::Claim => claims_resource(),
            Self::Sandbox => sandboxes_resource(),
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Self::Claim => "SandboxClaim",
            Self::Sandbox => "Sandbox",
        }
    }
}

impl KubernetesExecutor {
    /// A client for the configured cluster; nothing is asked of it yet ([`Self::check`]).
    pub async fn connect(config: KubernetesConfig) -> Result<Self, KubernetesError> {
        let mut kube_config = match (&config.url, &config.kubeconfig) {
            (Some(url), _) => {
                let uri: http::Uri = url
                    .parse()
                    .map_err(|e| KubernetesError::Config(format!("url `{url}`: {e}")))?;
                kube::Config::new(uri)
            }
            (None, Some(file)) => {
                let loaded = kube::config::Kubeconfig::read_from(file).map_err(|e| {
                    KubernetesError::Config(format!("reading {}: {e}", file.display()))
                })?;
                let options = kube::config::KubeConfigOptions {
                    context: config.context.clone(),
                    ..Default::default()
                };
                kube::Config::from_custom_kubeconfig(loaded, &options)
                    .await
                    .map_err(|e| KubernetesError::Config(format!("{}: {e}", file.display())))?
            }
            (None, None) => kube::Config::infer()
                .await
                .map_err(|e| KubernetesError::Config(e.to_string()))?,
        };
        // The exec stream of an idle session must not time out; every other request has its
        // own deadline here.
        kube_config.read_timeout = None;
        kube_config.connect_timeout = Some(Duration::from_secs(10));
        let url = kube_config.cluster_url.to_string();
        let client = kube::Client::try_from(kube_config)
            .map_err(|e| KubernetesError::Config(e.to_string()))?;
        let root = tandem_executor_kit::scratch::process_root_in(
            &config
                .workspace_dir
                .clone()
                .unwrap_or_else(std::env::temp_dir),
            "tandem-k8s-",
        );
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                client,
                url,
                owner: owner::owner_tag(),
                root,
                closed: Arc::default(),
            }),
        })
    }

    /// Its settings.
    pub fn config(&self) -> &KubernetesConfig {
        &self.inner.config
    }

    fn claims(&self) -> Api<DynamicObject> {
        self.held_api(Held::Claim)
    }

    fn held_api(&self, held: Held) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.inner.client.clone(),
            &self.inner.config.namespace,
            &held.resource(),
        )
    }

    /// Tandem's claims, and the sandboxes it made itself, as `(what, name, owner)`.
    async fn held_objects(&self) -> Result<Vec<(Held, String, String)>, KubernetesError> {
        let mut held = Vec::new();
        for (kind, selector) in [
            (Held::Claim, format!("{}=tandem", labels::MANAGED_BY)),
            (
                Held::Sandbox,
                format!("{}=tandem,{}=session", labels::MANAGED_BY, labels::MADE),
            ),
        ] {
            let listed = self
                .request(
                    &format!("listing Tandem's {}s", kind.kind()),
                    self.held_api(kind)
                        .list(&ListParams::default().labels(&selector)),
                )
                .await;
            let listed = match listed {
                Ok(listed) => listed,
                // A cluster whose Role predates sandboxes of Tandem's own: it can have made
                // none there, but say so, since one that could make them and not list them
                // would leave them behind.
                Err(KubernetesError::Api { reason, .. })
                    if kind == Held::Sandbox && reason.contains("403") =>
                {
                    tracing::warn!(%reason, "cannot list Tandem's own sandboxes; sessions with volumes will fail until the Role allows it");
                    continue;
                }
                Err(e) => return Err(e),
            };
            for object in listed.items {
                let owner = object
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(labels::OWNER))
                    .cloned()
                    .unwrap_or_default();
                if let Some(name) = object.metadata.name {
                    held.push((kind, name, owner));
                }
            }
        }
        Ok(held)
    }

    /// Whether the API server answers and serves the configured warm pool.
    pub async fn check(&self) -> Result<(), KubernetesError> {
        let c = &self.inner.config;
        let pools: Api<DynamicObject> = Api::namespaced_with(
            self.inner.client.clone(),
            &c.namespace,
            &warm_pools_resource(),
        );
        match self
            .request("reading the warm pool", pools.get_opt(&c.warm_pool))
            .await
        {
            Ok(Some(_)) => Ok(()),
            // A cluster without the agent-sandbox resources answers 404 as well, which the
            // client cannot tell from a missing pool; the advice covers both.
            Ok(None) => Err(KubernetesError::NoWarmPool {
                pool: c.warm_pool.clone(),
                namespace: c.namespace.clone(),
            }),
            Err(e) => Err(e),
        }
    }

    /// Runs one API request within [`REQUEST_LIMIT`], naming what failed.
    async fn request<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, KubernetesError> {
        match tokio::time::timeout(REQUEST_LIMIT, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(classify(&self.inner.url, what, e)),
            Err(_) => Err(KubernetesError::Unreachable {
                url: self.inner.url.clone(),
                reason: format!("{what} got no answer within {REQUEST_LIMIT:?}"),
            }),
        }
    }

    /// Deletes the claims of Tandems that no longer run (and their mirrors' directories);
    /// returns how many claims went.
    pub async fn reap_orphans(&self) -> Result<usize, KubernetesError> {
        tandem_executor_kit::scratch::reap_dead_roots_in(
            &self
                .inner
                .config
                .workspace_dir
                .clone()
                .unwrap_or_else(std::env::temp_dir),
            "tandem-k8s-",
        );
        let mut reaped = 0;
        for (held, name, owner) in self.held_objects().await? {
            if owner == self.inner.owner || owner::owner_alive(&owner) {
                continue;
            }
            tracing::info!(kind = held.kind(), %name, %owner, "deleting what a dead owner left");
            if self.delete_held(held, &name).await.is_ok() {
                reaped += 1;
            }
        }
        Ok(reaped)
    }

    /// Shuts the executor down (daemon shutdown): it makes no more claims, waits for those
    /// being made, and deletes every claim this process owns (with its sandbox and pod),
    /// within a deadline; what is left then, the next Tandem reaps.
    pub async fn shutdown(&self) {
        let closing = async {
            *self.inner.closed.write().await = true;
        };
        if tokio::time::timeout(REQUEST_LIMIT, closing).await.is_err() {
            tracing::warn!("claims still being made after 30 s; deleting what is there");
        }
        match tokio::time::timeout(REQUEST_LIMIT, self.delete_own()).await {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => tracing::info!(deleted = n, "deleted the claims still there at shutdown"),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "deleting the claims at shutdown failed; the next Tandem reaps them")
            }
            Err(_) => tracing::warn!(
                "deleting the claims at shutdown took over 30 s; the next Tandem reaps what is left"
            ),
        }
    }

    /// Deletes every claim and sandbox this process owns; returns how many.
    async fn delete_own(&self) -> Result<usize, KubernetesError> {
        let ours: Vec<(Held, String)> = self
            .held_objects()
            .await?
            .into_iter()
            .filter(|(_, _, owner)| *owner == self.inner.owner)
            .map(|(held, name, _)| (held, name))
            .collect();
        let deleted = futures::future::join_all(
            ours.iter()
                .map(|(held, name)| self.delete_held(*held, name)),
        )
        .await;
        Ok(deleted.iter().filter(|d| d.is_ok()).count())
    }

    /// Runs `make` (what makes a session's claim) on a task shutdown waits for; `None` once
    /// the executor is shut down.
    async fn making<T: Send + 'static>(
        &self,
        make: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Option<tokio::task::JoinHandle<T>> {
        let open = self.inner.closed.clone().read_owned().await;
        if *open {
            return None;
        }
        Some(tokio::spawn(async move {
            let made = make.await;
            drop(open);
            made
        }))
    }

    /// Deletes a claim and, through it, its sandbox and pod (or a sandbox Tandem made, and
    /// its pod); gone already is fine.
    pub(crate) async fn delete_held(&self, held: Held, name: &str) -> Result<(), KubernetesError> {
        match self
            .request(
                &format!("deleting a {}", held.kind()),
                self.held_api(held)
                    .delete(name, &DeleteParams::foreground()),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(KubernetesError::Api { reason, .. }) if reason.contains("NotFound") => Ok(()),
            Err(e) => {
                tracing::warn!(kind = held.kind(), %name, error = %e, "could not delete it; the next start reaps it");
                Err(e)
            }
        }
    }

    /// The labels and annotations of a new claim.
    fn claim_metadata(
        &self,
        session_id: &str,
        spec: &SessionSpec,
    ) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        let labels = BTreeMap::from([
            (labels::MANAGED_BY.to_owned(), "tandem".to_owned()),
            (
                labels::DAEMON.to_owned(),
                label_value(&self.inner.config.daemon_id),
            ),
            (labels::SESSION.to_owned(), session_id.to_owned()),
        ]);
        let mut annotations: BTreeMap<String, String> = spec
            .labels
            .iter()
            .map(|(k, v)| {
                let key = k.strip_prefix("tandem.").unwrap_or(k);
                (format!("tandem.dev/{}", label_value(key)), v.clone())
            })
            .collect();
        annotations.insert(labels::OWNER.to_owned(), self.inner.owner.clone());
        (labels, annotations)
    }
}

/// `text` as a label value: `[A-Za-z0-9_.-]`, at most 63 characters, alphanumeric at both
/// ends.
fn label_value(text: &str) -> String {
    let kept: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    kept.trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// A kube error as what it means here: the server gone, or what it answered.
fn classify(url: &str, what: &str, e: kube::Error) -> KubernetesError {
    match e {
        kube::Error::Api(status) => KubernetesError::Api {
            what: what.to_owned(),
            reason: if status.code == 403 {
                format!(
                    "{} ({} {}); the identity Tandem runs as lacks a permission: apply docs/deploy/kubernetes/rbac.yaml again (claims and sandboxes: create, get, list, delete; the pool and its template: get; PersistentVolumeClaims: create, get)",
                    status.message, status.code, status.reason
                )
            } else {
                format!("{} ({} {})", status.message, status.code, status.reason)
            },
        },
        other => {
            let mut reason = other.to_string();
            let mut source = std::error::Error::source(&other);
            while let Some(s) = source {
                reason = s.to_string();
                source = s.source();
            }
            KubernetesError::Unreachable {
                url: url.to_owned(),
                reason: format!("{what}: {reason}"),
            }
        }
    }
}

impl Executor for KubernetesExecutor {
    fn name(&self) -> &str {
        "kubernetes"
    }

    fn languages(&self) -> &[Language] {
        &self.inner.config.languages
    }

    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        let executor = self.clone();
        Box::pin(async move {
            let session = session::KubeSession::open(executor, spec).await?;
            Ok(Box::new(session) as Box<dyn Session>)
        })
    }

    fn health(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { self.check().await.map_err(|e| e.to_string()) })
    }

    fn carries_tool_calls(&self) -> bool {
        true
    }

    fn mounts_volumes(&self) -> bool {
        true
    }

    fn carries_egress(&self) -> bool {
        // Through a relay exec'd in the pod, over the API server's stream: the pod needs
        // no egress of its own.
        true
    }

    fn network(&self) -> bool {
        // The pod's network is the cluster's NetworkPolicy's to close, which Tandem cannot
        // see from here.
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values() {
        assert_eq!(label_value("tandem-123"), "tandem-123");
        assert_eq!(label_value("a/b:c"), "a-b-c");
        assert_eq!(label_value("-x-"), "x");
        assert_eq!(label_value(&"y".repeat(80)).len(), 63);
    }
}

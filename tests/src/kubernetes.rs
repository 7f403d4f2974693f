//! A stand-in Kubernetes API server for tests, since no cluster runs on this machine. It
//! answers the requests kube-rs really sends (JSON over HTTP, the exec subresource over a
//! WebSocket speaking `v5.channel.k8s.io`) and plays the agent-sandbox controller and the
//! kubelet with the system Docker engine: a `SandboxClaim` on a warm pool becomes a container
//! made from the pool's `SandboxTemplate` pod spec (its user, read-only root, dropped
//! capabilities, no privilege escalation, limits, emptyDir volumes as tmpfs, a service-account
//! token mounted unless the spec says not to, no network when a NetworkPolicy denies the
//! pod's egress), and exec runs `docker exec` in it.
//!
//! What it does not do is what only a cluster does: scheduling, admission (Pod Security),
//! a network plugin enforcing policy between nodes, warm pods started ahead (a claim starts
//! its container when it is made), watches, RBAC.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path as UrlPath, RawQuery, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bollard::Docker;
use bollard::exec::{CreateExecOptions, StartExecResults};
use bollard::models::{ContainerCreateBody, HostConfig};
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

/// The container label that marks what a fake cluster started, with its id.
pub const CONTAINER_LABEL: &str = "tandem.fake-kubernetes";

/// The pid limit the fake kubelet gives every pod (a node's `podPidsLimit`).
pub const NODE_POD_PIDS_LIMIT: i64 = 256;

/// Where a kubelet mounts a pod's service-account token.
pub const TOKEN_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

type Key = (String, String, String);

struct Cluster {
    id: String,
    docker: Docker,
    /// Every object, by (plural, namespace, name).
    objects: Mutex<BTreeMap<Key, Value>>,
    /// Pod name → container id.
    pods: Mutex<HashMap<String, String>>,
    /// `METHOD path` of every request, in order.
    log: Mutex<Vec<String>>,
    /// A file holding the token a pod gets when the spec does not turn it off.
    token_dir: tempfile::TempDir,
    /// How long the answer to a claim's or sandbox's creation waits, the object already made.
    claim_answer_delay: Mutex<std::time::Duration>,
    /// The storage behind each `PersistentVolumeClaim`: a directory per claim, made when the
    /// claim is (a provisioner that binds at once).
    volumes_dir: tempfile::TempDir,
}

/// A running stand-in API server.
pub struct FakeCluster {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    cluster: Arc<Cluster>,
    server: tokio::task::JoinHandle<()>,
    /// Whether [`FakeCluster::stop`] removed the pods already.
    stopped: bool,
}

impl Drop for FakeCluster {
    /// A test that fails before `stop` leaves no pod behind either: the engine is asked
    /// through its command line, since a drop cannot wait on the async client.
    fn drop(&mut self) {
        self.server.abort();
        if self.stopped {
            return;
        }
        let label = format!("label={CONTAINER_LABEL}={}", self.cluster.id);
        let Ok(listed) = std::process::Command::new("docker")
            .args(["ps", "-aq", "--filter", &label])
            .output()
        else {
            return;
        };
        let ids: Vec<String> = String::from_utf8_lossy(&listed.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        if !ids.is_empty() {
            let _ = std::process::Command::new("docker")
                .args(["rm", "-f", "-v"])
                .args(&ids)
                .output();
        }
    }
}

impl FakeCluster {
    /// Starts one on a free loopback port.
    pub async fn start() -> Self {
        let token_dir = tempfile::tempdir().unwrap();
        std::fs::write(token_dir.path().join("token"), "fake-service-account-token").unwrap();
        let cluster = Arc::new(Cluster {
            id: uuid::Uuid::new_v4().simple().to_string()[..12].to_owned(),
            docker: Docker::connect_with_local_defaults().unwrap(),
            objects: Mutex::default(),
            pods: Mutex::default(),
            log: Mutex::default(),
            token_dir,
            claim_answer_delay: Mutex::default(),
            volumes_dir: tempfile::tempdir().unwrap(),
        });
        let app = Router::new()
            .route("/api/v1/namespaces/{ns}/pods/{pod}/exec", get(exec))
            .fallback(resource)
            .with_state(cluster.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        // As a real API server does (Go sets it on every connection): without it, the
        // runner's small frames after a large one wait on the client's delayed ACK.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            url,
            cluster,
            server,
            stopped: false,
        }
    }

    /// One with the operator's resources of docs/deploy/kubernetes/ applied.
    pub async fn deployed() -> Self {
        let cluster = Self::start().await;
        cluster.apply_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/deploy/kubernetes"));
        cluster
    }

    /// The Kubernetes executor on this cluster with `config`'s other settings, checked.
    pub async fn executor_with(
        &self,
        config: tandem_executor_kubernetes::KubernetesConfig,
    ) -> tandem_executor_kubernetes::KubernetesExecutor {
        let executor = tandem_executor_kubernetes::KubernetesExecutor::connect(
            tandem_executor_kubernetes::KubernetesConfig {
                url: Some(self.url.clone()),
                ..config
            },
        )
        .await
        .unwrap();
        executor.check().await.unwrap();
        executor
    }

    /// The Kubernetes executor on this cluster's warm pool, checked.
    pub async fn executor(&self) -> tandem_executor_kubernetes::KubernetesExecutor {
        self.executor_with(Default::default()).await
    }

    /// Applies every object of the YAML files in `dir` (as `kubectl apply -f DIR`).
    pub fn apply_dir(&self, dir: &Path) {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .collect();
        files.sort();
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for doc in serde_yaml_ng::Deserializer::from_str(&text) {
                let object: Value = serde::Deserialize::deserialize(doc).unwrap();
                if object.is_null() {
                    continue;
                }
                self.apply(object);
            }
        }
    }

    /// Applies one object.
    pub fn apply(&self, object: Value) {
        let kind = object["kind"].as_str().unwrap_or_default();
        if kind == "Kustomization" {
            return;
        }
        let kind = kind.to_lowercase();
        let plural = if kind.ends_with('x') {
            format!("{kind}es")
        } else {
            format!("{kind}s").replace("policys", "policies")
        };
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        self.cluster
            .objects
            .lock()
            .unwrap()
            .insert((plural, ns, name), object);
    }

    /// Answers each claim's and sandbox's creation `delay` after making it, as a loaded API
    /// server does: a client that goes away meanwhile has one it never heard of.
    pub fn answer_claims_after(&self, delay: std::time::Duration) {
        *self.cluster.claim_answer_delay.lock().unwrap() = delay;
    }

    /// Removes one object, as `kubectl delete` would.
    pub fn remove(&self, plural: &str, ns: &str, name: &str) {
        self.cluster.objects.lock().unwrap().remove(&(
            plural.to_owned(),
            ns.to_owned(),
            name.to_owned(),
        ));
    }

    /// The objects of one kind, by plural.
    pub fn objects(&self, plural: &str) -> Vec<Value> {
        self.cluster
            .objects
            .lock()
            .unwrap()
            .iter()
            .filter(|((p, _, _), _)| p == plural)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// `METHOD path` of every request so far.
    pub fn requests(&self) -> Vec<String> {
        self.cluster.log.lock().unwrap().clone()
    }

    /// The pods' containers that exist on the engine now (running or not).
    pub async fn containers(&self) -> Vec<String> {
        let filters = HashMap::from([(
            "label".to_owned(),
            vec![format!("{CONTAINER_LABEL}={}", self.cluster.id)],
        )]);
        self.cluster
            .docker
            .list_containers(Some(
                bollard::query_parameters::ListContainersOptionsBuilder::default()
                    .all(true)
                    .filters(&filters)
                    .build(),
            ))
            .await
            .unwrap()
            .into_iter()
            .filter_map(|c| c.id)
            .collect()
    }

    /// Waits (a minute at most, for a loaded machine) until no claim or sandbox is left and
    /// no pod's container either; panics naming what stayed.
    pub async fn wait_released(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let claims = self.objects("sandboxclaims");
            let sandboxes = self.objects("sandboxes");
            let containers = self.containers().await;
            if claims.is_empty() && sandboxes.is_empty() && containers.is_empty() {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "left behind: claims {claims:?}, sandboxes {sandboxes:?}, containers {containers:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// The directory holding the files of claim `claim`'s volume, on this machine.
    pub fn volume_dir(&self, claim: &str) -> std::path::PathBuf {
        self.cluster.volumes_dir.path().join(claim)
    }

    /// The container of pod `pod`, if it has one.
    pub fn container_of(&self, pod: &str) -> Option<String> {
        self.cluster.pods.lock().unwrap().get(pod).cloned()
    }

    /// Stops answering (as an API server that went down) and removes every container.
    pub async fn stop(mut self) {
        self.server.abort();
        for id in self.containers().await {
            remove(&self.cluster.docker, &id).await;
        }
        self.stopped = true;
    }
}

/// Removes a pod's container, trying again while the engine refuses (a loaded engine can
/// answer "removal already in progress" or fail to unmount at once); gone is done.
async fn remove(docker: &Docker, id: &str) {
    for _ in 0..30 {
        let removed = docker
            .remove_container(
                id,
                Some(
                    bollard::query_parameters::RemoveContainerOptionsBuilder::default()
                        .force(true)
                        .v(true)
                        .build(),
                ),
            )
            .await;
        match removed {
            Ok(()) => return,
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => {
                return;
            }
            Err(e) => {
                eprintln!("stand-in cluster: removing container {id} failed, trying again: {e}");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    }
}

/// The one version served of each group.
static SERVED_VERSION: std::sync::LazyLock<HashMap<&'static str, &'static str>> =
    std::sync::LazyLock::new(|| {
        HashMap::from([
            ("extensions.agents.x-k8s.io", "v1beta1"),
            ("agents.x-k8s.io", "v1beta1"),
            ("networking.k8s.io", "v1"),
        ])
    });

fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    });
    (StatusCode::from_u16(code).unwrap(), axum::Json(body)).into_response()
}

fn success() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 200})
}

/// The CRUD part of the API: `/api/v1/...` and `/apis/GROUP/VERSION/...` namespaced
/// collections and objects.
async fn resource(
    State(cluster): State<Arc<Cluster>>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    cluster
        .log
        .lock()
        .unwrap()
        .push(format!("{method} {}", uri.path()));
    let parts: Vec<&str> = uri.path().trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, version, rest @ ..] if SERVED_VERSION.get(group) == Some(version) => {
            (*group, rest)
        }
        _ => {
            return status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            );
        }
    };
    let (ns, plural, name) = match rest {
        ["namespaces", ns, plural] => (*ns, *plural, None),
        ["namespaces", ns, plural, name] => (*ns, *plural, Some(*name)),
        _ => {
            return status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            );
        }
    };
    const SERVED: [(&str, &str); 6] = [
        ("", "persistentvolumeclaims"),
        ("extensions.agents.x-k8s.io", "sandboxclaims"),
        ("extensions.agents.x-k8s.io", "sandboxwarmpools"),
        ("extensions.agents.x-k8s.io", "sandboxtemplates"),
        ("agents.x-k8s.io", "sandboxes"),
        ("networking.k8s.io", "networkpolicies"),
    ];
    if !SERVED.contains(&(group, plural)) {
        return status(
            404,
            "NotFound",
            "the server could not find the requested resource",
        );
    }
    let key = |name: &str| (plural.to_owned(), ns.to_owned(), name.to_owned());
    match (method, name) {
        (Method::GET, Some(name)) => match cluster.objects.lock().unwrap().get(&key(name)) {
            Some(object) => axum::Json(object.clone()).into_response(),
            None => status(404, "NotFound", &format!("{plural} \"{name}\" not found")),
        },
        (Method::GET, None) => {
            let selector = uri
                .query()
                .unwrap_or_default()
                .split('&')
                .find_map(|kv| kv.strip_prefix("labelSelector="))
                .map(decode)
                .unwrap_or_default();
            let items: Vec<Value> = cluster
                .objects
                .lock()
                .unwrap()
                .iter()
                .filter(|((p, n, _), _)| p == plural && n == ns)
                .filter(|(_, v)| matches(&v["metadata"]["labels"], &selector))
                .map(|(_, v)| v.clone())
                .collect();
            axum::Json(json!({
                "kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                "items": items,
            }))
            .into_response()
        }
        (Method::POST, None) => {
            let Ok(mut object) = serde_json::from_slice::<Value>(&body) else {
                return status(400, "BadRequest", "the body is not JSON");
            };
            let Some(name) = object["metadata"]["name"].as_str().map(str::to_owned) else {
                return status(422, "Invalid", "metadata.name: Required value");
            };
            if cluster.objects.lock().unwrap().contains_key(&key(&name)) {
                return status(
                    409,
                    "AlreadyExists",
                    &format!("{plural} \"{name}\" already exists"),
                );
            }
            object["metadata"]["namespace"] = json!(ns);
            object["metadata"]["uid"] = json!(uuid::Uuid::new_v4().to_string());
            object["metadata"]["resourceVersion"] = json!("1");
            cluster
                .objects
                .lock()
                .unwrap()
                .insert(key(&name), object.clone());
            if plural == "persistentvolumeclaims" {
                std::fs::create_dir_all(cluster.volumes_dir.path().join(&name)).unwrap();
                object["status"] = json!({"phase": "Bound"});
            }
            if plural == "sandboxes" {
                // A sandbox made by a client rather than for a claim: its pod is its name.
                tokio::spawn(start_sandbox(cluster.clone(), ns.to_owned(), name.clone()));
            }
            if plural == "sandboxclaims" {
                tokio::spawn(bind(cluster.clone(), ns.to_owned(), name));
            }
            if plural == "sandboxclaims" || plural == "sandboxes" {
                let delay = *cluster.claim_answer_delay.lock().unwrap();
                tokio::time::sleep(delay).await;
            }
            (StatusCode::CREATED, axum::Json(object)).into_response()
        }
        (Method::DELETE, Some(name)) => {
            let Some(object) = cluster.objects.lock().unwrap().remove(&key(name)) else {
                return status(404, "NotFound", &format!("{plural} \"{name}\" not found"));
            };
            // The pod's removal runs on as a task of its own: a client that hangs up
            // mid-delete must not leave the pod half removed, as no kubelet would.
            let sandbox = if plural == "sandboxclaims" {
                object["status"]["sandbox"]["name"]
                    .as_str()
                    .map(str::to_owned)
            } else if plural == "sandboxes" {
                // Put back for `delete_sandbox`, which removes it with its pod.
                cluster.objects.lock().unwrap().insert(key(name), object);
                Some(name.to_owned())
            } else {
                None
            };
            if let Some(sandbox) = sandbox {
                let (cluster, ns) = (cluster.clone(), ns.to_owned());
                let _ = tokio::spawn(async move { delete_sandbox(&cluster, &ns, &sandbox).await })
                    .await;
            }
            axum::Json(success()).into_response()
        }
        _ => status(
            405,
            "MethodNotAllowed",
            "the server does not allow this method",
        ),
    }
}

/// Whether `labels` carry every `k=v` of `selector`.
fn matches(labels: &Value, selector: &str) -> bool {
    selector.split(',').filter(|s| !s.is_empty()).all(|term| {
        let (k, v) = term.split_once('=').unwrap_or((term, ""));
        labels[k].as_str() == Some(v)
    })
}

/// Percent-decoding of a query value.
fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn set_claim_status(cluster: &Cluster, ns: &str, claim: &str, status: Value) -> bool {
    let mut objects = cluster.objects.lock().unwrap();
    match objects.get_mut(&("sandboxclaims".to_owned(), ns.to_owned(), claim.to_owned())) {
        Some(object) => {
            object["status"] = status;
            true
        }
        None => false,
    }
}

fn not_ready(reason: &str, message: &str) -> Value {
    json!({"conditions": [{"type": "Ready", "status": "False", "reason": reason, "message": message}]})
}

/// The controller's part: gives a new claim a sandbox from its warm pool's template.
async fn bind(cluster: Arc<Cluster>, ns: String, claim: String) {
    let get = |plural: &str, name: &str| {
        cluster
            .objects
            .lock()
            .unwrap()
            .get(&(plural.to_owned(), ns.clone(), name.to_owned()))
            .cloned()
    };
    let Some(claim_object) = get("sandboxclaims", &claim) else {
        return;
    };
    let pool_name = claim_object["spec"]["warmPoolRef"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let Some(pool) = get("sandboxwarmpools", &pool_name) else {
        set_claim_status(
            &cluster,
            &ns,
            &claim,
            not_ready(
                "WarmPoolNotFound",
                &format!("SandboxWarmPool {pool_name} not found"),
            ),
        );
        return;
    };
    let template_name = pool["spec"]["sandboxTemplateRef"]["name"]
        .as_str()
        .unwrap_or_default();
    let Some(template) = get("sandboxtemplates", template_name) else {
        set_claim_status(
            &cluster,
            &ns,
            &claim,
            not_ready("TemplateNotFound", template_name),
        );
        return;
    };
    let pod_template = &template["spec"]["podTemplate"];
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..5];
    let sandbox = format!("{pool_name}-{suffix}");
    // A pod adopted from a pool is not named after the sandbox: the annotation says which.
    let pod = format!("{sandbox}-pod");
    if let Err(e) = start_pod(&cluster, &ns, &pod, pod_template).await {
        set_claim_status(&cluster, &ns, &claim, not_ready("PodFailed", &e));
        return;
    }
    cluster.objects.lock().unwrap().insert(
        ("sandboxes".to_owned(), ns.clone(), sandbox.clone()),
        json!({
            "apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
            "metadata": {
                "name": sandbox, "namespace": ns,
                "annotations": {"agents.x-k8s.io/pod-name": pod},
                "ownerReferences": [{"kind": "SandboxClaim", "name": claim}],
            },
            "spec": {"podTemplate": pod_template},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }),
    );
    let bound = set_claim_status(
        &cluster,
        &ns,
        &claim,
        json!({
            "sandbox": {"name": sandbox},
            "conditions": [{"type": "Ready", "status": "True", "reason": "SandboxReady"}],
        }),
    );
    if !bound {
        // Deleted while its pod started: the pod goes too.
        delete_sandbox(&cluster, &ns, &sandbox).await;
    }
}

/// The kubelet's part: starts pod `pod` of `template` in namespace `ns` as a container.
async fn start_pod(cluster: &Cluster, ns: &str, pod: &str, template: &Value) -> Result<(), String> {
    let policies = cluster
        .objects
        .lock()
        .unwrap()
        .iter()
        .filter(|((p, n, _), _)| p == "networkpolicies" && *n == ns)
        .map(|(_, v)| v.clone())
        .collect::<Vec<_>>();
    let body = pod_container(cluster, ns, template, &policies)?;
    let id = cluster
        .docker
        .create_container(
            Some(
                bollard::query_parameters::CreateContainerOptionsBuilder::default()
                    .name(&format!("fake-k8s-{}-{pod}", cluster.id))
                    .build(),
            ),
            body,
        )
        .await
        .map_err(|e| e.to_string())?
        .id;
    if let Err(e) = cluster.docker.start_container(&id, None).await {
        remove(&cluster.docker, &id).await;
        return Err(e.to_string());
    }
    cluster.pods.lock().unwrap().insert(pod.to_owned(), id);
    Ok(())
}

/// The controller's part for a sandbox a client made: starts its pod (named as it is) and
/// marks it ready, or says why not.
async fn start_sandbox(cluster: Arc<Cluster>, ns: String, sandbox: String) {
    let key = ("sandboxes".to_owned(), ns.clone(), sandbox.clone());
    let Some(object) = cluster.objects.lock().unwrap().get(&key).cloned() else {
        return;
    };
    let status = match start_pod(&cluster, &ns, &sandbox, &object["spec"]["podTemplate"]).await {
        Ok(()) => {
            json!({"conditions": [{"type": "Ready", "status": "True", "reason": "DependenciesReady"}]})
        }
        Err(e) => not_ready("PodFailed", &e),
    };
    let present = match cluster.objects.lock().unwrap().get_mut(&key) {
        Some(object) => {
            object["status"] = status;
            true
        }
        None => false,
    };
    if !present {
        // Deleted while its pod started: the pod goes too.
        let id = cluster.pods.lock().unwrap().remove(&sandbox);
        if let Some(id) = id {
            remove(&cluster.docker, &id).await;
        }
    }
}

async fn delete_sandbox(cluster: &Cluster, ns: &str, sandbox: &str) {
    let object = cluster.objects.lock().unwrap().remove(&(
        "sandboxes".to_owned(),
        ns.to_owned(),
        sandbox.to_owned(),
    ));
    let pod = object.as_ref().map(|o| {
        o["metadata"]["annotations"]["agents.x-k8s.io/pod-name"]
            .as_str()
            .unwrap_or(sandbox)
            .to_owned()
    });
    if let Some(pod) = pod {
        let id = cluster.pods.lock().unwrap().remove(&pod);
        if let Some(id) = id {
            remove(&cluster.docker, &id).await;
        }
    }
}

/// A Kubernetes quantity (`512Mi`, `1Gi`, `250m`, `1`) in base units, times 1000 for CPU
/// millis when `milli`.
fn quantity(text: &str, milli: bool) -> Option<i64> {
    let units: [(&str, f64); 7] = [
        ("Ki", 1024.0),
        ("Mi", 1024.0 * 1024.0),
        ("Gi", 1024.0 * 1024.0 * 1024.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("m", 1e-3),
    ];
    let (number, factor) = units
        .iter()
        .find_map(|(suffix, f)| text.strip_suffix(suffix).map(|n| (n, *f)))
        .unwrap_or((text, 1.0));
    let value = number.parse::<f64>().ok()? * factor;
    Some(if milli { value * 1e3 } else { value } as i64)
}

/// What a kubelet would run for the pod template's first container, as a Docker container;
/// why not, when a claim it mounts is not there.
fn pod_container(
    cluster: &Cluster,
    ns: &str,
    template: &Value,
    policies: &[Value],
) -> Result<ContainerCreateBody, String> {
    let spec = &template["spec"];
    let container = &spec["containers"][0];
    let pod_security = &spec["securityContext"];
    let security = &container["securityContext"];
    let pick = |field: &str| {
        security
            .get(field)
            .filter(|v| !v.is_null())
            .or_else(|| pod_security.get(field).filter(|v| !v.is_null()))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let user = match (pick("runAsUser").as_i64(), pick("runAsGroup").as_i64()) {
        (Some(u), Some(g)) => Some(format!("{u}:{g}")),
        (Some(u), None) => Some(u.to_string()),
        _ => None,
    };
    let limits = &container["resources"]["limits"];
    let mut tmpfs = HashMap::new();
    let mut binds = Vec::new();
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        let name = mount["name"].as_str().unwrap_or_default();
        let path = mount["mountPath"].as_str().unwrap_or_default();
        let volume = spec["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == name);
        if let Some(empty_dir) = volume.map(|v| &v["emptyDir"]).filter(|e| e.is_object()) {
            // An emptyDir is a fresh directory open to every user of the pod.
            let size = empty_dir["sizeLimit"]
                .as_str()
                .and_then(|s| quantity(s, false))
                .unwrap_or(1 << 30);
            tmpfs.insert(
                path.to_owned(),
                format!("rw,exec,nosuid,nodev,size={size},mode=0777"),
            );
        }
        if let Some(claim) = volume
            .map(|v| &v["persistentVolumeClaim"])
            .filter(|c| c.is_object())
        {
            let claim_name = claim["claimName"].as_str().unwrap_or_default();
            let key = (
                "persistentvolumeclaims".to_owned(),
                ns.to_owned(),
                claim_name.to_owned(),
            );
            if !cluster.objects.lock().unwrap().contains_key(&key) {
                return Err(format!("persistentvolumeclaim \"{claim_name}\" not found"));
            }
            let dir = cluster.volumes_dir.path().join(claim_name);
            // As a kubelet applies the pod's fsGroup to a volume: the group owns it, and
            // what is made in it inherits the group.
            if let Some(group) = spec["securityContext"]["fsGroup"].as_u64() {
                use std::os::unix::fs::PermissionsExt;
                std::os::unix::fs::chown(&dir, None, Some(group as u32))
                    .map_err(|e| e.to_string())?;
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o2775))
                    .map_err(|e| e.to_string())?;
            }
            let read_only = mount["readOnly"] == json!(true) || claim["readOnly"] == json!(true);
            binds.push(format!(
                "{}:{path}:{}",
                dir.display(),
                if read_only { "ro" } else { "rw" }
            ));
        }
    }
    if spec["automountServiceAccountToken"] != json!(false) {
        binds.push(format!(
            "{}:{TOKEN_DIR}:ro",
            cluster.token_dir.path().display()
        ));
    }
    let labels = &template["metadata"]["labels"];
    let denied = policies.iter().any(|p| {
        let selects = p["spec"]["podSelector"]["matchLabels"]
            .as_object()
            .is_none_or(|m| m.iter().all(|(k, v)| &labels[k] == v));
        let types = p["spec"]["policyTypes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        selects && types.contains(&json!("Egress")) && p["spec"]["egress"].is_null()
    });
    let drop: Vec<String> = security["capabilities"]["drop"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str().map(str::to_owned))
        .collect();
    let memory = limits["memory"].as_str().and_then(|m| quantity(m, false));
    Ok(ContainerCreateBody {
        image: container["image"].as_str().map(str::to_owned),
        cmd: container["command"].as_array().map(|c| {
            c.iter()
                .filter_map(|a| a.as_str().map(str::to_owned))
                .collect()
        }),
        entrypoint: Some(Vec::new()),
        user,
        labels: Some(HashMap::from([(
            CONTAINER_LABEL.to_owned(),
            cluster.id.clone(),
        )])),
        host_config: Some(HostConfig {
            network_mode: Some(if denied { "none" } else { "bridge" }.to_owned()),
            cap_drop: (!drop.is_empty()).then_some(drop),
            security_opt: (security["allowPrivilegeEscalation"] == json!(false))
                .then(|| vec!["no-new-privileges".to_owned()]),
            readonly_rootfs: security["readOnlyRootFilesystem"].as_bool(),
            tmpfs: Some(tmpfs),
            binds: Some(binds),
            pids_limit: Some(NODE_POD_PIDS_LIMIT),
            memory,
            memory_swap: memory,
            nano_cpus: limits["cpu"]
                .as_str()
                .and_then(|c| quantity(c, true))
                .map(|millis| millis * 1_000_000),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The exec subresource: a WebSocket whose binary messages carry a channel byte (0 stdin,
/// 1 stdout, 2 stderr, 3 status, 255 close) and then the bytes.
async fn exec(
    State(cluster): State<Arc<Cluster>>,
    UrlPath((_ns, pod)): UrlPath<(String, String)>,
    RawQuery(query): RawQuery,
    ws: WebSocketUpgrade,
) -> Response {
    cluster.log.lock().unwrap().push(format!("GET exec {pod}"));
    let mut command = Vec::new();
    let mut stdin = false;
    for kv in query.unwrap_or_default().split('&') {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        match k {
            "command" => command.push(decode(v)),
            "stdin" => stdin = v == "true",
            _ => {}
        }
    }
    let Some(id) = cluster.pods.lock().unwrap().get(&pod).cloned() else {
        return status(404, "NotFound", &format!("pods \"{pod}\" not found"));
    };
    ws.protocols(["v5.channel.k8s.io", "v4.channel.k8s.io"])
        .max_message_size(64 << 20)
        .on_upgrade(move |socket| bridge(cluster, id, command, stdin, socket))
}

async fn bridge(
    cluster: Arc<Cluster>,
    id: String,
    command: Vec<String>,
    stdin: bool,
    socket: WebSocket,
) {
    let docker = &cluster.docker;
    let (mut to_client, mut from_client) = socket.split();
    let send_status = |status: Value| {
        let mut message = vec![3u8];
        message.extend_from_slice(status.to_string().as_bytes());
        Message::Binary(message.into())
    };
    let created = docker
        .create_exec(
            &id,
            CreateExecOptions {
                cmd: Some(command),
                attach_stdin: Some(stdin),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                ..Default::default()
            },
        )
        .await;
    let started = match created {
        Ok(exec) => docker
            .start_exec(&exec.id, None)
            .await
            .map(|s| (exec.id, s)),
        Err(e) => Err(e),
    };
    let (exec_id, output, input) = match started {
        Ok((exec_id, StartExecResults::Attached { output, input })) => (exec_id, output, input),
        Ok(_) => return,
        Err(e) => {
            let _ = to_client
                .send(send_status(json!({
                    "metadata": {}, "status": "Failure",
                    "message": e.to_string(), "reason": "InternalError",
                })))
                .await;
            return;
        }
    };
    let feed = async move {
        let mut input = input;
        while let Some(Ok(message)) = from_client.next().await {
            match message {
                Message::Binary(bytes) if bytes.first() == Some(&0) => {
                    if input.write_all(&bytes[1..]).await.is_err() {
                        break;
                    }
                    let _ = input.flush().await;
                }
                Message::Binary(bytes) if bytes.as_ref() == [255, 0] => break,
                Message::Close(_) => break,
                _ => {}
            }
        }
        // The client closed stdin or went away: the process sees the end of its input.
        let _ = input.shutdown().await;
    };
    let feeder = tokio::spawn(feed);
    let mut output = output;
    while let Some(Ok(item)) = output.next().await {
        let (channel, bytes) = match item {
            bollard::container::LogOutput::StdOut { message } => (1u8, message),
            bollard::container::LogOutput::StdErr { message } => (2u8, message),
            _ => continue,
        };
        let mut message = Vec::with_capacity(bytes.len() + 1);
        message.push(channel);
        message.extend_from_slice(&bytes);
        if to_client
            .send(Message::Binary(message.into()))
            .await
            .is_err()
        {
            break;
        }
    }
    feeder.abort();
    // The engine may report the exec as running for a moment after its output ends.
    let mut code = -1;
    for _ in 0..3000 {
        match docker.inspect_exec(&exec_id).await {
            Ok(i) if i.running != Some(true) => {
                code = i.exit_code.unwrap_or(-1);
                break;
            }
            Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            Err(_) => break,
        }
    }
    let status = if code == 0 {
        json!({"metadata": {}, "status": "Success"})
    } else {
        json!({
            "metadata": {}, "status": "Failure",
            "message": format!("command terminated with non-zero exit code: {code}"),
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
        })
    };
    let _ = to_client.send(send_status(status)).await;
    let _ = to_client.close().await;
}

//! The Kubernetes executor against a stand-in API server (`tandem_tests::kubernetes`) that
//! answers kube-rs's real requests over HTTP and the exec WebSocket, with the resources of
//! docs/deploy/kubernetes/ applied and each claimed pod a real hardened container.

use std::sync::Arc;
use std::time::Duration;

use tandem_executor::{Executor, ExitStatus, SessionSpec};
use tandem_executor_kubernetes::{KubernetesConfig, KubernetesExecutor};
use tandem_tests::conformance::{self, run};
use tandem_tests::kubernetes::FakeCluster;

async fn cluster() -> FakeCluster {
    FakeCluster::deployed().await
}

async fn executor(cluster: &FakeCluster) -> KubernetesExecutor {
    cluster.executor().await
}

#[tokio::test(flavor = "multi_thread")]
async fn kubernetes_executor_passes_the_conformance_suite() {
    let cluster = cluster().await;
    let executor = executor(&cluster).await;
    conformance::all(Arc::new(executor.clone()), &[]).await;
    // Every session's claim, and with it its pod, is gone.
    cluster.wait_released().await;
    // The runner went in over exec, not as a container of Tandem's own.
    let requests = cluster.requests();
    assert!(
        requests.iter().any(|r| r.starts_with("GET exec ")),
        "{requests:?}"
    );
    assert!(
        requests.iter().any(|r| r.starts_with(
            "POST /apis/extensions.agents.x-k8s.io/v1beta1/namespaces/tandem/sandboxclaims"
        )),
        "{requests:?}"
    );
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_pod_runs_blocks_as_the_templates_hardened_user() {
    let cluster = cluster().await;
    let executor = executor(&cluster).await;
    let mut s = conformance::open(&executor, Default::default()).await;
    let code = "import errno, os\nprint(os.getuid(), os.getgid())\nprint(os.path.exists('/var/run/secrets/kubernetes.io/serviceaccount/token'))\ntry:\n    open('/etc/x', 'w')\n    print('root writable')\nexcept OSError as e:\n    print('read-only', errno.errorcode[e.errno])\nprint(open('/proc/1/cmdline').read().split(chr(0))[0])\nprint(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\nprint(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])";
    let out = run(&mut *s, "python", code).await;
    assert_eq!(
        out.stdout.to_text(),
        "65534 65534\nFalse\nread-only EROFS\nsleep\n0000000000000000\n1\n",
        "{}",
        out.stderr.to_text()
    );
    // Files come back to the mirror on this machine after every block.
    let ws = s.workspace().unwrap().to_owned();
    run(&mut *s, "sh", "mkdir -p d && echo made > d/f.txt").await;
    assert_eq!(
        std::fs::read_to_string(ws.join("d/f.txt")).unwrap(),
        "made\n"
    );
    s.close().await.unwrap();
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_template_without_the_token_opt_out_would_hand_blocks_the_clusters_credentials() {
    // The pod spec decides; the fake kubelet mounts a token unless it says not to, so this
    // shows the template's `automountServiceAccountToken: false` is what keeps it out.
    let cluster = cluster().await;
    let mut template = cluster.objects("sandboxtemplates").remove(0);
    template["spec"]["podTemplate"]["spec"]
        .as_object_mut()
        .unwrap()
        .remove("automountServiceAccountToken");
    cluster.apply(template);
    let executor = executor(&cluster).await;
    let mut s = conformance::open(&executor, Default::default()).await;
    let out = run(
        &mut *s,
        "sh",
        "cat /var/run/secrets/kubernetes.io/serviceaccount/token",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "fake-service-account-token");
    s.close().await.unwrap();
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn claims_go_on_close_on_drop_and_when_their_owner_died() {
    let cluster = cluster().await;
    let executor = executor(&cluster).await;
    // Dropped without close, as a cancelled task's session is.
    let s = conformance::open(&executor, Default::default()).await;
    assert_eq!(cluster.objects("sandboxclaims").len(), 1);
    assert_eq!(cluster.containers().await.len(), 1);
    drop(s);
    cluster.wait_released().await;
    // A claim a dead Tandem on this machine left is reaped; a live one's (ours) is not.
    let ours = executor
        .open(SessionSpec::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let host = tandem_executor_kit::owner::hostname();
    cluster.apply(serde_json::json!({
        "apiVersion": "extensions.agents.x-k8s.io/v1beta1", "kind": "SandboxClaim",
        "metadata": {
            "name": "left-behind", "namespace": "tandem",
            "labels": {"app.kubernetes.io/managed-by": "tandem"},
            "annotations": {"tandem.dev/owner": format!("{host}/999999999:1")},
        },
        "spec": {"warmPoolRef": {"name": "tandem"}},
    }));
    assert_eq!(executor.reap_orphans().await.unwrap(), 1);
    let left: Vec<String> = cluster
        .objects("sandboxclaims")
        .iter()
        .map(|c| c["metadata"]["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_ne!(left[0], "left-behind");
    ours.close().await.unwrap();
    assert!(cluster.objects("sandboxclaims").is_empty());
    cluster.wait_released().await;
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runner_that_dies_is_started_again_in_the_same_pod_with_the_files_kept() {
    let cluster = cluster().await;
    let executor = executor(&cluster).await;
    let mut s = conformance::open(&executor, Default::default()).await;
    run(&mut *s, "sh", "echo kept > kept.txt").await;
    let out = run(&mut *s, "sh", "kill -9 $PPID; sleep 1; echo unreachable").await;
    assert_ne!(out.status, ExitStatus::Exited(0));
    let after = run(&mut *s, "sh", "cat kept.txt").await;
    assert_eq!(
        after.stdout.to_text(),
        "kept\n",
        "{}",
        after.stderr.to_text()
    );
    // Still one pod: the runner came back, the sandbox was not replaced.
    assert_eq!(cluster.containers().await.len(), 1);
    s.close().await.unwrap();
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_name_the_pool_the_server_and_what_to_do() {
    let cluster = cluster().await;
    // A pool that is not there: said at the check, and by an open that waited for it.
    let missing = KubernetesExecutor::connect(KubernetesConfig {
        url: Some(cluster.url.clone()),
        warm_pool: "nope".to_owned(),
        ready_timeout: Duration::from_secs(2),
        ..KubernetesConfig::default()
    })
    .await
    .unwrap();
    let checked = missing.check().await.unwrap_err().to_string();
    insta::assert_snapshot!("kubernetes_no_pool", checked);
    let opened = missing
        .open(SessionSpec::default())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        opened.contains("SandboxWarmPool `nope` does not exist"),
        "{opened}"
    );
    cluster.wait_released().await;
    // No API server at all.
    let url = cluster.url.clone();
    cluster.stop().await;
    let down = KubernetesExecutor::connect(KubernetesConfig {
        url: Some(url.clone()),
        ..KubernetesConfig::default()
    })
    .await
    .unwrap();
    let checked = down.check().await.unwrap_err().to_string();
    assert!(
        checked.starts_with(&format!("cannot reach the Kubernetes API at {url}/")),
        "{checked}"
    );
    assert!(checked.contains("Connection refused"), "{checked}");
    let opened = down
        .open(SessionSpec::default())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        opened.contains("cannot reach the Kubernetes API"),
        "{opened}"
    );
}

async fn open_with(
    executor: &KubernetesExecutor,
    spec: SessionSpec,
) -> Box<dyn tandem_executor::Session> {
    executor.open(spec).await.unwrap_or_else(|e| panic!("{e}"))
}

/// A volume binding for `name` at `path`; the directory on this machine is not used by a pod.
fn volume(
    name: &str,
    path: &str,
    read_only: bool,
    max_mb: Option<u64>,
) -> tandem_executor::VolumeBinding {
    tandem_executor::VolumeBinding {
        name: name.to_owned(),
        host_dir: std::path::PathBuf::from("/nonexistent"),
        path: path.to_owned(),
        read_only,
        max_mb,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_volume_is_a_claim_that_outlives_the_pods_that_mount_it() {
    let cluster = cluster().await;
    let executor = executor(&cluster).await;
    let with = |volumes| SessionSpec {
        volumes,
        ..Default::default()
    };
    // The first session makes the claim (its quota as its size) and writes into it.
    let mut s = open_with(
        &executor,
        with(vec![volume("results_v1", "/data", false, Some(64))]),
    )
    .await;
    let claims = cluster.objects("persistentvolumeclaims");
    assert_eq!(claims.len(), 1, "{claims:?}");
    let claim = claims[0]["metadata"]["name"].as_str().unwrap().to_owned();
    assert!(claim.starts_with("tandem-volume-results-v1."), "{claim}");
    assert_eq!(
        claims[0]["spec"]["resources"]["requests"]["storage"],
        "64Mi"
    );
    assert_eq!(claims[0]["spec"]["accessModes"][0], "ReadWriteOnce");
    assert_eq!(
        claims[0]["metadata"]["annotations"]["tandem.dev/volume"],
        "results_v1"
    );
    // Its own Sandbox, not a claim on the pool: a pooled pod has no such volume.
    assert!(cluster.objects("sandboxclaims").is_empty());
    let sandboxes = cluster.objects("sandboxes");
    assert_eq!(sandboxes.len(), 1);
    let pod = &sandboxes[0]["spec"]["podTemplate"];
    assert_eq!(
        pod["metadata"]["labels"]["app.kubernetes.io/name"], "tandem-sandbox",
        "the template's NetworkPolicy must still select it"
    );
    assert_eq!(pod["spec"]["automountServiceAccountToken"], false);
    let out = run(&mut *s, "sh", "id -u; echo kept > /data/out.txt && mkdir -p /data/d && echo deep > /data/d/f && cat /data/out.txt").await;
    assert_eq!(
        out.stdout.to_text(),
        "65534\nkept\n",
        "{}",
        out.stderr.to_text()
    );
    s.close().await.unwrap();
    cluster.wait_released().await;
    // The pod is gone; the claim and its files are not.
    assert_eq!(cluster.objects("persistentvolumeclaims").len(), 1);
    assert_eq!(
        std::fs::read_to_string(cluster.volume_dir(&claim).join("d/f")).unwrap(),
        "deep\n"
    );

    // The next session mounts the same claim read-only: it reads, and cannot write.
    let mut s = open_with(
        &executor,
        with(vec![volume("results_v1", "/results", true, None)]),
    )
    .await;
    let out = run(
        &mut *s,
        "python",
        "import errno\nprint(open('/results/d/f').read().strip())\ntry:\n    open('/results/new', 'w')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])",
    )
    .await;
    assert_eq!(
        out.stdout.to_text(),
        "deep\nEROFS\n",
        "{}",
        out.stderr.to_text()
    );
    assert_eq!(
        cluster.objects("persistentvolumeclaims").len(),
        1,
        "one claim per volume"
    );
    // A Sandbox a dead Tandem made for such a session is reaped; this one (ours) is not.
    let host = tandem_executor_kit::owner::hostname();
    cluster.apply(serde_json::json!({
        "apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
        "metadata": {
            "name": "left-behind", "namespace": "tandem",
            "labels": {"app.kubernetes.io/managed-by": "tandem", "tandem.dev/made": "session"},
            "annotations": {"tandem.dev/owner": format!("{host}/999999999:1")},
        },
        "spec": {"podTemplate": {}},
    }));
    assert_eq!(executor.reap_orphans().await.unwrap(), 1);
    assert_eq!(cluster.objects("sandboxes").len(), 1);
    // Dropped without close (a cancelled task): its sandbox goes, the claim stays.
    drop(s);
    cluster.wait_released().await;
    assert_eq!(cluster.objects("persistentvolumeclaims").len(), 1);

    // Inside the workspace (copied out after each block) or over the template's /tmp: refused
    // before anything is made.
    for (path, says) in [
        ("data", "absolute path such as /data"),
        ("/tmp/x", "/tmp is already mounted there"),
    ] {
        let e = executor
            .open(with(vec![volume("other", path, false, None)]))
            .await
            .err()
            .unwrap_or_else(|| panic!("{path} was mounted"))
            .to_string();
        assert!(e.contains(says), "{path}: {e}");
    }
    assert!(cluster.objects("sandboxes").is_empty());
    // Shutdown deletes what this process holds, never a volume's claim.
    let s = open_with(
        &executor,
        with(vec![volume("results_v1", "/data", false, None)]),
    )
    .await;
    executor.shutdown().await;
    assert!(
        cluster.objects("sandboxes").is_empty(),
        "shutdown deletes the sandboxes it made"
    );
    drop(s);
    cluster.wait_released().await;
    assert_eq!(cluster.objects("persistentvolumeclaims").len(), 1);
    cluster.stop().await;
}

//! Volumes through the daemon: named storage written by one task and read by the next, on
//! Docker and local alike, its quota and read-only mounts enforced by the kernel, and never
//! removed while a sandbox has it.

use std::path::Path;

use serde_json::json;
use tandem_tests::daemon::DaemonHarness;
use tandem_tests::{Reply, ScriptedOpenAi, script};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_outlives_its_tasks_its_quota_and_read_only_hold_and_it_stays_while_mounted() {
    let write = "volumes: keep the answer";
    let read = "volumes: read the answer";
    let server = ScriptedOpenAi::start(script([
        (
            write,
            vec![
                Reply::Text(crate::e2e::fence(
                    "python",
                    "import os\nos.makedirs('/data/out', exist_ok=True)\nopen('/data/out/answer.txt', 'w').write('42')\nprint(sorted(os.listdir('/data')))",
                )),
                Reply::from("Kept.\n\nTERMINATE"),
            ],
        ),
        (
            read,
            vec![
                Reply::Text(crate::e2e::fence(
                    "python",
                    "print(open('shared/out/answer.txt').read())\ntry:\n    open('shared/out/answer.txt', 'w').write('changed')\n    print('wrote')\nexcept OSError as e:\n    print('refused', e.errno)",
                )),
                Reply::from("Read.\n\nTERMINATE"),
            ],
        ),
    ]))
    .await
    .unwrap();
    let d = DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--executor", "docker"],
        Some("[policy]\nexecutors = [\"docker\", \"local\", \"wasm\"]\n"),
    )
    .await;
    let (code, out, err) = d
        .cli(&["volume", "create", "shared", "--max-mb", "8"])
        .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("shared  "), "{out}");

    // Written by a task on Docker, at an absolute path.
    let first = d
        .submit(json!({"task": write, "executor": "docker", "volumes": [{"name": "shared", "path": "/data"}]}))
        .await;
    let view = d
        .wait_finished(&first, std::time::Duration::from_secs(120))
        .await;
    assert_eq!(
        d.block_stdouts(&first).await.join(""),
        "['out']\n",
        "{view:?}"
    );
    // Read by the next, on the local executor, read-only, through the CLI's road; its write
    // is refused by the kernel (EACCES from Landlock), and the file keeps its bytes.
    let (code, out, err) = d
        .cli(&[
            "submit",
            "-e",
            "local",
            "--volume",
            "shared:shared:ro",
            "--model",
            "m",
            read,
        ])
        .await;
    assert_eq!(code, 0, "{err}");
    let second = out.trim().to_owned();
    let view = d
        .wait_finished(&second, std::time::Duration::from_secs(120))
        .await;
    assert_eq!(
        d.block_stdouts(&second).await.join(""),
        "42\nrefused 13\n",
        "{view:?}"
    );

    // The quota: a write past 8 MiB fails as on a full disk, whatever was written before.
    let (status, session) = d
        .open_session(
            json!({"executor": "docker", "volumes": [{"name": "shared", "path": "/data"}]}),
        )
        .await;
    assert_eq!(status, 201, "{session}");
    let id = session["id"].as_str().unwrap().to_owned();
    let ran = d.exec_python(
        &id,
        "import errno\ntry:\n    with open('/data/big', 'wb') as f:\n        for _ in range(20):\n            f.write(b'x' * (1 << 20))\n            f.flush()\n    print('all written')\nexcept OSError as e:\n    print('full', e.errno == errno.ENOSPC)\nprint(open('/data/out/answer.txt').read())",
    )
    .await;
    assert_eq!(ran["stdout"], "full True\n42\n", "{ran}");
    let info = d.get("/v1/volumes/shared").await;
    assert_eq!(
        (info["max_mb"].as_u64(), info["mounted_by"].as_u64()),
        (Some(8), Some(1)),
        "{info}"
    );
    assert!(info["used_bytes"].as_u64().unwrap() > 6 << 20, "{info}");

    // Read-only on Docker is the kernel's: the write fails with EROFS.
    let (status, ro) = d.open_session(
        json!({"executor": "docker", "volumes": [{"name": "shared", "path": "/ro", "read_only": true}]}),
    )
    .await;
    assert_eq!(status, 201, "{ro}");
    let ro = ro["id"].as_str().unwrap().to_owned();
    let ran = d.exec_python(
        &ro,
        "try:\n    open('/ro/out/answer.txt', 'w')\nexcept OSError as e:\n    print('refused', e.errno)",
    )
    .await;
    assert_eq!(ran["stdout"], "refused 30\n", "{ran}");
    d.send(reqwest::Method::DELETE, &format!("/v1/sessions/{ro}"), None)
        .await;

    // Never removed while mounted: refused naming why, and removed once the session closes.
    let (code, _, err) = d.cli(&["volume", "rm", "shared"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("mounted by 1 open sandbox"), "{err}");
    let (status, _) = d
        .send(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await;
    assert!(status < 300, "{status}");
    let (code, out, err) = d.cli(&["volume", "rm", "shared"]).await;
    assert_eq!((code, out.as_str()), (0, "shared removed\n"), "{err}");

    // Unknown volumes are 404 naming them; an executor without volumes and a bad path are
    // refused naming the fix.
    let (status, body) = d
        .open_session(
            json!({"executor": "docker", "volumes": [{"name": "shared", "path": "/data"}]}),
        )
        .await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no volume `shared`"),
        "{body}"
    );
    let (code, _, err) = d.cli(&["volume", "create", "plain"]).await;
    assert_eq!(code, 0, "{err}");
    for (spec, says) in [
        (
            json!({"executor": "wasm", "volumes": [{"name": "plain", "path": "data"}]}),
            "cannot mount volumes; use docker, local or kubernetes",
        ),
        (
            json!({"executor": "docker", "volumes": [{"name": "plain", "path": "/proc/x"}]}),
            "beneath /proc",
        ),
        (
            json!({"executor": "local", "volumes": [{"name": "plain", "path": "/data"}]}),
            "inside the workspace",
        ),
    ] {
        let (status, body) = d.open_session(spec.clone()).await;
        assert!(
            (400..500).contains(&status) || status == 503,
            "{spec}: {status} {body}"
        );
        assert!(
            body["error"]["message"].as_str().unwrap().contains(says),
            "{spec}: {body}"
        );
    }
    let listed = d.get("/v1/volumes").await;
    assert_eq!(listed["volumes"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed["volumes"][0]["name"], "plain");

    // A local block reaches only its own session's volumes, whatever link it plants: the
    // link swapped for one to another volume's directory reads nothing there.
    let (code, _, err) = d.cli(&["volume", "create", "other"]).await;
    assert_eq!(code, 0, "{err}");
    let other = d.state_dir().join("files/volumes/other");
    std::fs::write(other.join("secret.txt"), "not yours").unwrap();
    let canary = tempfile::tempdir().unwrap();
    std::fs::write(canary.path().join("keep.txt"), "host file").unwrap();
    let (status, session) = d
        .open_session(json!({"executor": "local", "volumes": [{"name": "plain", "path": "mine"}]}))
        .await;
    assert_eq!(status, 201, "{session}");
    let id = session["id"].as_str().unwrap().to_owned();
    let swapped = format!(
        "import os\nos.remove('mine')\nos.symlink({other:?}, 'mine')\ntry:\n    print(open('mine/secret.txt').read())\nexcept OSError as e:\n    print('refused', e.errno)"
    );
    assert_eq!(d.exec_python(&id, &swapped).await["stdout"], "refused 13\n");
    // A link a block leaves in a volume is never followed by the daemon: removing the
    // volume removes the link, not what it names on the host.
    let canary_dir = canary.path().display().to_string();
    let planted = format!(
        "import os\nos.remove('mine')\nos.symlink({:?}, 'mine')\n",
        d.state_dir()
            .join("files/volumes/plain")
            .display()
            .to_string()
    );
    d.exec_python(&id, &planted).await;
    let ran = d.exec_python(
        &id,
        &format!("import os\nos.symlink({canary_dir:?}, 'mine/escape')\nprint(sorted(os.listdir('mine')))"),
    )
    .await;
    assert_eq!(ran["stdout"], "['escape']\n", "{ran}");
    d.send(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await;
    for name in ["plain", "other"] {
        let (code, _, err) = d.cli(&["volume", "rm", name]).await;
        assert_eq!(code, 0, "{err}");
    }
    assert_eq!(
        std::fs::read_to_string(canary.path().join("keep.txt")).unwrap(),
        "host file"
    );
    assert!(!other.exists());
}

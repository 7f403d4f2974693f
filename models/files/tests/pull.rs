//! Pulling against a real HTTP server on loopback standing in for the hub.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tandem_model_files::{
    HubFile, ModelDir, ModelFilesError, ModelSpec, Progress, Source, Sources, pull,
};

#[derive(Clone, Default)]
struct Hub {
    data: Arc<Vec<u8>>,
    /// Cut the first response after this many bytes.
    cut_first_at: Option<usize>,
    /// The Range header of every request, in order.
    seen: Arc<Mutex<Vec<Option<String>>>>,
}

async fn serve_file(
    State(hub): State<Hub>,
    Path(rest): Path<String>,
    headers: HeaderMap,
) -> Response {
    let range = headers.get("range").map(|v| v.to_str().unwrap().to_owned());
    let first = {
        let mut seen = hub.seen.lock().unwrap();
        seen.push(range.clone());
        seen.len() == 1
    };
    if rest != "org/model-GGUF/resolve/main/model.gguf" {
        return StatusCode::NOT_FOUND.into_response();
    }
    let from: usize = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .map_or(0, |n| n.parse().unwrap());
    let body = hub.data[from..].to_vec();
    let status = if from > 0 {
        StatusCode::PARTIAL_CONTENT
    } else {
        StatusCode::OK
    };
    match hub.cut_first_at.filter(|_| first) {
        Some(at) => {
            // Half the body, then the connection breaks.
            let head = body[..at].to_vec();
            // The break comes a moment later, so that the head is sent first.
            let stream = futures::stream::iter(vec![Ok(head), Err(std::io::Error::other("cut"))])
                .then(|item| async move {
                    if item.is_err() {
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                    item
                });
            (status, Body::from_stream(stream)).into_response()
        }
        None => (status, body).into_response(),
    }
}

async fn start(hub: Hub) -> String {
    let app = axum::Router::new()
        .route("/{*rest}", axum::routing::get(serve_file))
        .with_state(hub);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn spec_for(data: &[u8]) -> ModelSpec {
    ModelSpec {
        name: "test-model".into(),
        summary: "a test file".into(),
        file: "model.gguf".into(),
        size: data.len() as u64,
        sha256: hex::encode(Sha256::digest(data)),
        hub: Some(HubFile {
            repo: "org/model-GGUF".into(),
            path: "model.gguf".into(),
        }),
        pypi: None,
    }
}

fn sources(endpoint: String) -> Sources {
    // reqwest is built without a TLS provider of its own; Tandem installs ring's.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Sources {
        http: reqwest::Client::new(),
        hub_endpoint: endpoint,
        python: None,
        attempts: 3,
    }
}

/// A hub on loopback serving 300 kB as the test model (its first response cut after
/// `cut_first_at` bytes, if set), an empty models directory, and the model's spec.
struct Fixture {
    data: Vec<u8>,
    seen: Arc<Mutex<Vec<Option<String>>>>,
    endpoint: String,
    tmp: tempfile::TempDir,
    dir: ModelDir,
    spec: ModelSpec,
}

async fn fixture(cut_first_at: Option<usize>) -> Fixture {
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let hub = Hub {
        data: Arc::new(data.clone()),
        cut_first_at,
        ..Hub::default()
    };
    let seen = hub.seen.clone();
    let endpoint = start(hub).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = ModelDir::new(tmp.path());
    let spec = spec_for(&data);
    Fixture {
        data,
        seen,
        endpoint,
        tmp,
        dir,
        spec,
    }
}

#[tokio::test]
async fn a_cut_download_resumes_with_a_range_request_and_is_checked() {
    let f = fixture(Some(100_000)).await;
    let mut events = Vec::new();
    let pulled = pull(&f.dir, &f.spec, &sources(f.endpoint.clone()), &mut |p| {
        events.push(p)
    })
    .await
    .unwrap();
    assert_eq!(pulled.source, Some(Source::Hub));
    assert_eq!(std::fs::read(&pulled.path).unwrap(), f.data);
    assert_eq!(
        *f.seen.lock().unwrap(),
        vec![None, Some("bytes=100000-".to_owned())]
    );
    assert!(events.contains(&Progress::Trying {
        source: Source::Hub,
        total: 300_000,
        resumed_at: 100_000
    }));
    assert_eq!(events.last(), Some(&Progress::Verifying));
    assert_eq!(
        std::fs::read_dir(f.dir.path()).unwrap().count(),
        1,
        "no .part left"
    );
    // Pulled again: already there, nothing fetched.
    let again = pull(&f.dir, &f.spec, &sources(f.endpoint), &mut |_| {})
        .await
        .unwrap();
    assert_eq!(again.source, None);
    assert_eq!(f.seen.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_download_cut_every_time_keeps_its_part_for_the_next_pull() {
    let f = fixture(Some(120_000)).await;
    let one_try = Sources {
        attempts: 1,
        ..sources(f.endpoint.clone())
    };
    let e = pull(&f.dir, &f.spec, &one_try, &mut |_| {})
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("was cut at 120000 of 300000 bytes") && text.contains("run the pull again"),
        "{text}"
    );
    assert_eq!(
        std::fs::metadata(f.tmp.path().join("model.gguf.part"))
            .unwrap()
            .len(),
        120_000
    );
    let pulled = pull(&f.dir, &f.spec, &one_try, &mut |_| {}).await.unwrap();
    assert_eq!(std::fs::read(pulled.path).unwrap(), f.data);
}

#[tokio::test]
async fn a_wrong_sha256_is_refused_and_nothing_is_kept() {
    let mut f = fixture(None).await;
    f.spec.sha256 = "00".repeat(32);
    let e = pull(&f.dir, &f.spec, &sources(f.endpoint), &mut |_| {})
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("could not pull test-model from any source:\nthe Hugging Face hub: model.gguf from the Hugging Face hub has sha256 ")
            && text.contains(&format!(", not {}; the download was removed", "00".repeat(32))),
        "{text}"
    );
    assert_eq!(std::fs::read_dir(f.tmp.path()).unwrap().count(), 0);
}

#[tokio::test]
async fn a_missing_file_and_an_unreachable_hub_name_the_url() {
    let mut f = fixture(None).await;
    let endpoint = f.endpoint.clone();
    f.spec.hub.as_mut().unwrap().path = "missing.gguf".into();
    let e = pull(&f.dir, &f.spec, &sources(endpoint.clone()), &mut |_| {})
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "could not pull test-model from any source:\nthe Hugging Face hub: {endpoint}/org/model-GGUF/resolve/main/missing.gguf is not there (404); check HF_ENDPOINT if you set it"
        )
    );
    // Nothing listens on port 9 here.
    let spec = spec_for(&f.data);
    let e = pull(
        &f.dir,
        &spec,
        &sources("http://127.0.0.1:9".into()),
        &mut |_| {},
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("cannot reach http://127.0.0.1:9/org/model-GGUF/resolve/main/model.gguf")
            && e.contains("refused"),
        "{e}"
    );
}

#[tokio::test]
async fn too_little_disk_space_is_said_before_anything_is_fetched() {
    let mut f = fixture(None).await;
    f.spec.size = 1 << 60;
    let e = pull(&f.dir, &f.spec, &sources(f.endpoint), &mut |_| {})
        .await
        .unwrap_err();
    assert!(matches!(e, ModelFilesError::NoSpace { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.starts_with(&format!(
            "not enough disk space in {}: the model needs 1152921504607 MB more and ",
            f.tmp.path().display()
        )) && text.ends_with("free some space or set TANDEM_MODELS_DIR to a larger disk"),
        "{text}"
    );
    assert!(f.seen.lock().unwrap().is_empty());
}

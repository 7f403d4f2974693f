//! `/v1/tasks/{id}/ports/{port}/…`, `/v1/sessions/{id}/ports/{port}/…` and the signed links
//! `/v1/ports/{link}/…`: HTTP and WebSocket carried to a server listening in a sandbox.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::json;
use tandem_executor::{ExecError, Ports};
use tandem_protocol::ApiErrorCode;

use super::{ApiError, AppState, read_limited};
use crate::ports::Holder;
use crate::sandbox::Owner;

/// How long a server in a sandbox gets to send its answer's head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a link lasts when its asker does not say, and at most.
const LINK_SECS: u64 = 3600;
const MOST_LINK_SECS: u64 = 7 * 24 * 3600;

/// What a page served from a sandbox may do: run scripts, but in an origin of its own, so
/// that it can read nothing of the daemon's (the web page's token) and send nothing as it.
const SANDBOXED: &str =
    "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads";

fn param<'a>(params: &'a HashMap<String, String>, name: &str) -> &'a str {
    params.get(name).map(String::as_str).unwrap_or_default()
}

fn port_of(params: &HashMap<String, String>) -> Result<u16, ApiError> {
    let text = param(params, "port");
    text.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
        ApiError::invalid(format!(
            "`{text}` is not a port: give a number from 1 to 65535"
        ))
    })
}

/// Where a holder's sandboxes are reached, and its name in errors. A session is the API's;
/// through a signed link (`any_owner`), any holder's, an MCP connection's among them.
fn dialers(
    state: &AppState,
    holder: Holder,
    id: &str,
    any_owner: bool,
) -> Result<Vec<Arc<dyn Ports>>, ApiError> {
    match holder {
        Holder::Task => {
            let open = state.supervisor.ports.of(id);
            if open.is_empty() {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    ApiErrorCode::NotFound,
                    format!(
                        "task {id} has no open sandbox whose ports can be reached: a task's ports are served while it runs, on an executor that publishes them (docker)"
                    ),
                ));
            }
            Ok(open)
        }
        Holder::Session => {
            let opened = match state.sessions.find(id).filter(|_| any_owner) {
                Some(opened) => opened,
                None => state.sessions.get(Owner::Api, id)?,
            };
            match opened.ports() {
                Some(ports) => Ok(vec![ports]),
                None => Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    ApiErrorCode::NotFound,
                    format!(
                        "session {id} runs on the {} executor, whose ports Tandem cannot reach; open the session on docker to publish a port",
                        opened.executor()
                    ),
                )),
            }
        }
    }
}

/// `ANY /v1/tasks/{id}/ports/{port}/{*rest}`.
pub(super) async fn task_port(
    State(state): State<AppState>,
    Path(params): Path<HashMap<String, String>>,
    req: Request,
) -> Response {
    carry(&state, Holder::Task, params, req).await
}

/// `ANY /v1/sessions/{id}/ports/{port}/{*rest}`.
pub(super) async fn session_port(
    State(state): State<AppState>,
    Path(params): Path<HashMap<String, String>>,
    req: Request,
) -> Response {
    carry(&state, Holder::Session, params, req).await
}

/// `ANY /v1/ports/{link}/{*rest}`: a signed link, which stands in for the token.
pub(super) async fn linked_port(
    State(state): State<AppState>,
    Path(mut params): Path<HashMap<String, String>>,
    req: Request,
) -> Response {
    let link = param(&params, "link").to_owned();
    let (holder, id, port) = match state.supervisor.links.check(&link, crate::now_ms() / 1000) {
        Ok(opened) => opened,
        Err(why) => {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                ApiErrorCode::Unauthorized,
                format!("this port link does not open anything: {why}; ask for a new one (POST /v1/tasks/{{id}}/links or /v1/sessions/{{id}}/links)"),
            )
            .into_response();
        }
    };
    params.insert("id".to_owned(), id);
    params.insert("port".to_owned(), port.to_string());
    let prefix = format!("/v1/ports/{link}/");
    match dialers(&state, holder, &params["id"], true) {
        Ok(open) => forward(open, port, &prefix, param(&params, "rest"), req).await,
        Err(e) => e.into_response(),
    }
}

/// A port's path without its last slash: the slash is added, so that the server's relative
/// links resolve beneath the prefix.
pub(super) async fn add_slash(req: Request) -> Response {
    let path = req.uri().path();
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    Redirect::permanent(&format!("{path}/{query}")).into_response()
}

async fn carry(
    state: &AppState,
    holder: Holder,
    params: HashMap<String, String>,
    req: Request,
) -> Response {
    let port = match port_of(&params) {
        Ok(port) => port,
        Err(e) => return e.into_response(),
    };
    let id = param(&params, "id");
    let prefix = format!("/v1/{}/{id}/ports/{port}/", holder.word());
    match dialers(state, holder, id, false) {
        Ok(open) => forward(open, port, &prefix, param(&params, "rest"), req).await,
        Err(e) => e.into_response(),
    }
}

/// Sends `req` to `port` of the first sandbox in `open` where something listens, as `/rest`,
/// and its answer back; an upgrade (WebSocket) is carried both ways once both sides agree.
async fn forward(
    open: Vec<Arc<dyn Ports>>,
    port: u16,
    prefix: &str,
    rest: &str,
    mut req: Request,
) -> Response {
    let mut stream = None;
    let mut refused = None;
    for ports in open {
        match ports.dial(port).await {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => refused = Some(e),
        }
    }
    let Some(stream) = stream else {
        let code = match &refused {
            Some(ExecError::PortClosed { .. }) => ApiErrorCode::NotFound,
            _ => ApiErrorCode::ExecutorUnavailable,
        };
        let why = refused.map_or_else(String::new, |e| e.to_string());
        return ApiError::new(StatusCode::BAD_GATEWAY, code, why).into_response();
    };
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let Ok(uri) = format!("/{rest}{query}").parse::<axum::http::Uri>() else {
        return ApiError::invalid("the path is not one a server can be asked for").into_response();
    };
    *req.uri_mut() = uri;
    // The daemon's token is the daemon's: the sandbox's server never sees it.
    req.headers_mut().remove(header::AUTHORIZATION);
    if let Ok(prefix) = HeaderValue::from_str(prefix) {
        req.headers_mut().insert("x-forwarded-prefix", prefix);
    }
    let client_side = req
        .headers()
        .contains_key(header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(stream)).await {
            Ok(pair) => pair,
            Err(e) => return bad_gateway(port, &e.to_string()),
        };
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "a connection to a sandbox's port ended with an error");
        }
    });
    let mut answer = match tokio::time::timeout(HEAD_TIMEOUT, sender.send_request(req)).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => return bad_gateway(port, &e.to_string()),
        Err(_) => {
            return ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                ApiErrorCode::ExecutorUnavailable,
                format!(
                    "the server on port {port} sent no answer within {} s",
                    HEAD_TIMEOUT.as_secs()
                ),
            )
            .into_response();
        }
    };
    if answer.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_side) = client_side
    {
        let server_side = hyper::upgrade::on(&mut answer);
        tokio::spawn(async move {
            if let (Ok(client), Ok(server)) = (client_side.await, server_side.await) {
                let (mut client, mut server) = (TokioIo::new(client), TokioIo::new(server));
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            }
        });
    }
    let (mut parts, body) = answer.into_parts();
    parts.headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(SANDBOXED),
    );
    Response::from_parts(parts, Body::new(body))
}

fn bad_gateway(port: u16, why: &str) -> Response {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        ApiErrorCode::ExecutorUnavailable,
        format!("the server on port {port} in the sandbox did not answer in HTTP: {why}"),
    )
    .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkAsked {
    port: u16,
    #[serde(default)]
    ttl_secs: Option<u64>,
}

/// `POST /v1/tasks/{id}/links` and `/v1/sessions/{id}/links`: a link to one port that opens
/// it without the token until it expires, for a browser.
pub(super) async fn task_link(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    link(&state, Holder::Task, id, headers, body).await
}

/// See [`task_link`].
pub(super) async fn session_link(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    link(&state, Holder::Session, id, headers, body).await
}

async fn link(
    state: &AppState,
    holder: Holder,
    id: String,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let body = read_limited(&headers, body, state.body_limit).await?;
    let asked: LinkAsked = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(format!(
            "the body is not a link request: {e}; send JSON like {{\"port\": 8000, \"ttl_secs\": 3600}}"
        ))
    })?;
    if asked.port == 0 {
        return Err(ApiError::invalid("port 0 is not a port: give 1 to 65535"));
    }
    let ttl = asked.ttl_secs.unwrap_or(LINK_SECS);
    if ttl == 0 || ttl > MOST_LINK_SECS {
        return Err(ApiError::invalid(format!(
            "ttl_secs {ttl} is out of range: a link lasts from 1 s to {MOST_LINK_SECS} s (7 days)"
        )));
    }
    // Only for what is open now: a link to nothing would be a puzzle later.
    dialers(state, holder, &id, false)?;
    let expires = crate::now_ms() / 1000 + ttl;
    let link = state
        .supervisor
        .links
        .sign(holder, &id, asked.port, expires);
    Ok(axum::Json(json!({
        "url": format!("/v1/ports/{link}/"),
        "port": asked.port,
        "expires": expires,
    })))
}

/// `GET /v1/tasks/{id}/ports`: the ports its open sandboxes' code listens on now.
pub(super) async fn task_ports(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    listed(&state, Holder::Task, &id).await
}

/// `GET /v1/sessions/{id}/ports`.
pub(super) async fn session_ports(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    listed(&state, Holder::Session, &id).await
}

async fn listed(
    state: &AppState,
    holder: Holder,
    id: &str,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    let mut ports = std::collections::BTreeSet::new();
    for open in dialers(state, holder, id, false)? {
        let listening = open.listening().await.map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                ApiErrorCode::ExecutorUnavailable,
                e.to_string(),
            )
        })?;
        ports.extend(listening);
    }
    let word = holder.word();
    let ports: Vec<serde_json::Value> = ports
        .into_iter()
        .map(|port| json!({"port": port, "path": format!("/v1/{word}/{id}/ports/{port}/")}))
        .collect();
    Ok(axum::Json(json!({ "ports": ports })))
}

/// The routes that serve one sandbox port beneath `/{secret}/`, and nothing else.
fn loopback(ports: Arc<dyn Ports>, port: u16, secret: &str) -> axum::Router {
    let prefix = format!("/{secret}/");
    let secret = secret.to_owned();
    let serve = move |Path(params): Path<HashMap<String, String>>, req: Request| {
        let (ports, prefix, secret) = (ports.clone(), prefix.clone(), secret.clone());
        async move {
            let given = param(&params, "secret");
            if !bool::from(subtle::ConstantTimeEq::ct_eq(
                given.as_bytes(),
                secret.as_bytes(),
            )) {
                return StatusCode::NOT_FOUND.into_response();
            }
            forward(vec![ports], port, &prefix, param(&params, "rest"), req).await
        }
    };
    axum::Router::new()
        .route("/{secret}", axum::routing::any(add_slash))
        .route("/{secret}/", axum::routing::any(serve.clone()))
        .route("/{secret}/{*rest}", axum::routing::any(serve))
}

/// Serves `port` of a sandbox on this machine's loopback, beneath a path of its own that is
/// the only way in, until `stop`; the URL. For `tandem run` in process, which has no daemon.
pub async fn serve_loopback(
    ports: Arc<dyn Ports>,
    port: u16,
    stop: tandem_executor::CancellationToken,
) -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let secret = uuid::Uuid::new_v4().simple().to_string();
    let app = loopback(ports, port, &secret);
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::debug!(error = %e, "serving a port on loopback ended");
        }
    });
    Ok(format!("http://{addr}/{secret}/"))
}

//! The web page: one HTML file, its script and its style sheet, embedded in the binary (no
//! build step, nothing fetched from elsewhere). The page holds no data; it reads the API
//! with the token the person gives it, so it is served without one.

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const INDEX: &str = include_str!("web/index.html");
const SCRIPT: &str = include_str!("web/app.js");
const STYLE: &str = include_str!("web/app.css");

/// What the page may load and run: its own script and style only, API calls to its own
/// origin, no frames. Model output shown on the page is text, and even markup that slipped
/// through could run no inline script or load nothing. Pictures a task drew are fetched with
/// the token and shown from `blob:` URLs the page made itself.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data: blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The page's routes: `/` (the task list) and `/tasks/{id}` (one task) are the same page.
pub fn router() -> Router {
    Router::new()
        .route("/", get(index))
        .route("/tasks/{id}", get(index))
        .route("/assets/app.js", get(script))
        .route("/assets/app.css", get(style))
}

fn page(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // Embedded in the binary: a new build may change them, so they are not kept.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

async fn index() -> Response {
    page("text/html; charset=utf-8", INDEX)
}

async fn script() -> Response {
    page("text/javascript; charset=utf-8", SCRIPT)
}

async fn style() -> Response {
    page("text/css; charset=utf-8", STYLE)
}

//! [`Browser`]: headless Chromium driven over the W3C WebDriver protocol (chromedriver from
//! the system packages), for tests of the web page in a real browser.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Where the system packages put them (Debian's `chromium` and `chromium-driver`).
const CHROMIUM: &str = "/usr/bin/chromium";
const DRIVER: &str = "/usr/bin/chromedriver";

/// The W3C name of the property that identifies an element in answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A headless Chromium session; dropped, it asks the driver to quit the browser, then kills
/// the driver (killed alone, the driver would leave the browser running).
pub struct Browser {
    driver: tokio::process::Child,
    http: reqwest::Client,
    base: String,
    /// The driver's port and the session's path, for the quit sent from `drop`.
    quit: (u16, String),
}

impl Drop for Browser {
    fn drop(&mut self) {
        use std::io::{Read, Write};
        let (port, path) = &self.quit;
        // Blocking and bounded: `drop` cannot await, and a test that panicked still ends
        // its browser.
        let Ok(mut conn) = std::net::TcpStream::connect(("127.0.0.1", *port)) else {
            return;
        };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        let _ = conn.set_write_timeout(Some(Duration::from_secs(10)));
        let request = format!(
            "DELETE {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        if conn.write_all(request.as_bytes()).is_ok() {
            // The answer comes once the browser is gone.
            let mut answer = Vec::new();
            let _ = conn.read_to_end(&mut answer);
        }
        let _ = self.driver.start_kill();
    }
}

impl Browser {
    /// Starts chromedriver and a headless Chromium `width` x `height`. Fails, naming the
    /// packages to install, when either is missing.
    pub async fn start(width: u32, height: u32) -> Self {
        for (path, package) in [(CHROMIUM, "chromium"), (DRIVER, "chromium-driver")] {
            assert!(
                std::path::Path::new(path).exists(),
                "{path} is missing: install the Debian package `{package}` (scripts/install-test-tools.sh does)"
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = tokio::process::Command::new(DRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let root = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        while http.get(format!("{root}/status")).send().await.is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "chromedriver did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", format!("--window-size={width},{height}")],
            },
        }}});
        let answer: Value = http
            .post(format!("{root}/session"))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = answer["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("chromedriver made no session: {answer}"))
            .to_owned();
        Self {
            driver,
            http,
            base: format!("{root}/session/{session}"),
            quit: (port, format!("/session/{session}")),
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(body) = body {
            req = req.json(&body);
        }
        let answer: Value = req.send().await.unwrap().json().await.unwrap();
        if answer["value"]["error"].is_string() {
            panic!("webdriver {path}: {}", answer["value"]);
        }
        answer["value"].clone()
    }

    /// Opens `url` and waits for the page to load.
    pub async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    /// Runs `script` (a function body; `arguments` holds `args`) in the page; its result.
    pub async fn run(&self, script: &str, args: Value) -> Value {
        self.call(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({ "script": script, "args": args })),
        )
        .await
    }

    /// Waits until `script` returns something truthy (within `limit`); returns it.
    pub async fn wait(&self, what: &str, script: &str, limit: Duration) -> Value {
        let started = Instant::now();
        loop {
            let v = self.run(script, json!([])).await;
            let truthy =
                !matches!(&v, Value::Null | Value::Bool(false)) && v != json!(0) && v != json!("");
            if truthy {
                return v;
            }
            assert!(
                started.elapsed() < limit,
                "waited {limit:?} for {what}; the page shows:\n{}",
                self.run("return document.body.innerText", json!([])).await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The element `css` selects (the first).
    pub async fn find(&self, css: &str) -> String {
        let v = self
            .call(
                reqwest::Method::POST,
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element `{css}`: {v}"))
            .to_owned()
    }

    /// Clicks the element `css` selects, as a person would (the driver moves the pointer).
    pub async fn click(&self, css: &str) {
        let el = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{el}/click"),
            Some(json!({})),
        )
        .await;
    }

    /// Types `text` into the element `css` selects.
    pub async fn type_into(&self, css: &str, text: &str) {
        let el = self.find(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{el}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// Resizes the window.
    pub async fn resize(&self, width: u32, height: u32) {
        self.call(
            reqwest::Method::POST,
            "/window/rect",
            Some(json!({"width": width, "height": height})),
        )
        .await;
    }

    /// A PNG of the window.
    pub async fn screenshot(&self) -> Vec<u8> {
        use base64::Engine as _;
        let v = self.call(reqwest::Method::GET, "/screenshot", None).await;
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap())
            .unwrap()
    }

    /// Ends the session and the driver.
    pub async fn quit(mut self) {
        let _ = self.http.delete(&self.base).send().await;
        let _ = self.driver.kill().await;
    }
}

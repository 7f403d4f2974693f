//! Picking the executor a command runs on: by name, or `auto` (docker when it is usable,
//! else local with a warning).

use std::sync::Arc;

use anyhow::{Result, bail};
use tandem_executor::{Executor, Language};
use tandem_executor_docker::{DockerError, DockerExecutor};
use tandem_executor_local::LocalExecutor;

use crate::config::{self, FileConfig};

/// Names `--executor` accepts.
pub const NAMES: &str = "auto, docker, local";

/// The executor called `name` (or the one `auto` picks), ready to open sessions.
pub async fn resolve(
    name: &str,
    file: &FileConfig,
    image: Option<&str>,
) -> Result<Arc<dyn Executor>> {
    match name {
        "local" => Ok(local(file)),
        "docker" => {
            let docker = DockerExecutor::connect(config::docker_config(file, image)?).await?;
            docker
                .ensure_image(&|line| eprintln!("tandem: {line}"))
                .await?;
            Ok(Arc::new(docker))
        }
        "auto" => {
            let (executor, why) = auto(file, image).await?;
            if executor.name() == "local" {
                eprintln!(
                    "tandem: warning: running code with the local executor, which is not a security boundary ({why})"
                );
            }
            Ok(executor)
        }
        other => bail!("executor `{other}` is not registered; available: {NAMES}"),
    }
}

/// What `auto` picks, and why.
pub async fn auto(file: &FileConfig, image: Option<&str>) -> Result<(Arc<dyn Executor>, String)> {
    let config = config::docker_config(file, image)?;
    let image = config.image.clone();
    let connected = DockerExecutor::connect(config).await;
    let why_not = why_not_docker(connected.as_ref(), &image).await;
    Ok(match (connected, why_not) {
        (Ok(docker), None) => (Arc::new(docker), docker_why(&image)),
        (_, why_not) => (local(file), why_not.unwrap_or_default()),
    })
}

/// Why `auto` picks docker.
pub fn docker_why(image: &str) -> String {
    format!("the Docker engine answers and image `{image}` is present")
}

/// Why `auto` cannot pick docker, given a connection the caller made; `None` when it can.
pub async fn why_not_docker(
    connected: Result<&DockerExecutor, &DockerError>,
    image: &str,
) -> Option<String> {
    match connected {
        Ok(docker) => match docker.image_present().await {
            Ok(true) => None,
            Ok(false) => Some(format!(
                "docker: image `{image}` is not present; pull it, or build one offline with scripts/build-sandbox-image.sh and set TANDEM_DOCKER_IMAGE=tandem-sandbox:latest"
            )),
            Err(e) => Some(format!("docker: {e}")),
        },
        Err(DockerError::Unreachable { host, .. }) => {
            Some(format!("docker: no engine answers at {host}"))
        }
        Err(e) => Some(format!("docker: {e}")),
    }
}

fn local(file: &FileConfig) -> Arc<dyn Executor> {
    Arc::new(LocalExecutor::new(config::local_config(file)))
}

/// `tandem doctor`'s executor lines.
pub async fn report(file: &FileConfig, image: Option<&str>) -> Result<Vec<String>> {
    let langs = |l: &[Language]| {
        l.iter()
            .map(Language::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut lines = Vec::new();
    let local = local(file);
    lines.push(format!(
        "executor:  local ({}) - not a security boundary",
        langs(local.languages())
    ));
    let config = config::docker_config(file, image)?;
    let image_name = config.image.clone();
    let connected = DockerExecutor::connect(config).await;
    match &connected {
        Ok(docker) => {
            let version = docker
                .engine_version()
                .await
                .unwrap_or_else(|e| e.to_string());
            let present = match docker.image_present().await {
                Ok(true) => "present".to_owned(),
                Ok(false) => "missing: pull it or run scripts/build-sandbox-image.sh".to_owned(),
                Err(e) => e.to_string(),
            };
            lines.push(format!(
                "executor:  docker ({}) - engine {version}, image `{image_name}` {present}",
                langs(docker.languages())
            ));
        }
        Err(e) => lines.push(format!("executor:  docker - unavailable: {e}")),
    }
    let auto = match why_not_docker(connected.as_ref(), &image_name).await {
        None => format!("docker ({})", docker_why(&image_name)),
        Some(why) => format!("local ({why})"),
    };
    lines.push(format!("auto:      {auto}"));
    Ok(lines)
}

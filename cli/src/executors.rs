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
    let why = match DockerExecutor::connect(config).await {
        Ok(docker) => match docker.image_present().await {
            Ok(true) => {
                let why = format!("the Docker engine answers and image `{image}` is present");
                return Ok((Arc::new(docker), why));
            }
            Ok(false) => format!(
                "docker: image `{image}` is not present; pull it, or build one offline with scripts/build-sandbox-image.sh and set TANDEM_DOCKER_IMAGE=tandem-sandbox:latest"
            ),
            Err(e) => format!("docker: {e}"),
        },
        Err(DockerError::Unreachable { host, .. }) => {
            format!("docker: no engine answers at {host}")
        }
        Err(e) => format!("docker: {e}"),
    };
    Ok((local(file), why))
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
    match DockerExecutor::connect(config).await {
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
    let (picked, why) = auto(file, image).await?;
    lines.push(format!("auto:      {} ({why})", picked.name()));
    Ok(lines)
}

//! Team files: read, parsed with the path of a bad field, and checked.

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use tandem_agent::team::{Node, check, path_error};
use tandem_protocol::team::TeamSpec;

/// Reads and checks a team file, for a daemon to run.
pub fn load_spec(path: &Path) -> Result<TeamSpec> {
    let (spec, _) = read(path)?;
    Ok(spec)
}

/// Reads and checks a team file; the error lists every problem, each with its field's path.
pub fn load(path: &Path) -> Result<Node> {
    let (_, root) = read(path)?;
    Ok(root)
}

fn read(path: &Path) -> Result<(TeamSpec, Node)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the team file {}", path.display()))?;
    let problems = |lines: Vec<String>| {
        anyhow!(
            "the team file {} does not check:\n  {}",
            path.display(),
            lines.join("\n  ")
        )
    };
    let de = toml::Deserializer::parse(&text).map_err(|e| problems(vec![e.to_string()]))?;
    let spec: TeamSpec =
        serde_path_to_error::deserialize(de).map_err(|e| problems(vec![path_error(&e)]))?;
    let root = check(&spec).map_err(|e| problems(e.0))?;
    Ok((spec, root))
}

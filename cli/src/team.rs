//! Team files: read, parsed with the path of a bad field, and checked.

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use tandem_agent::team::{Node, check_within, path_error};
use tandem_protocol::team::{TeamBounds, TeamSpec};

/// Reads and checks a team file, for a daemon to run (which checks it within its own
/// bounds again).
pub fn load_spec(path: &Path, bounds: &TeamBounds) -> Result<TeamSpec> {
    let (spec, _) = read(path, bounds)?;
    Ok(spec)
}

/// Reads and checks a team file; the error lists every problem, each with its field's path.
pub fn load(path: &Path, bounds: &TeamBounds) -> Result<Node> {
    let (_, root) = read(path, bounds)?;
    Ok(root)
}

fn read(path: &Path, bounds: &TeamBounds) -> Result<(TeamSpec, Node)> {
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
    let root = check_within(&spec, bounds).map_err(|e| problems(e.0))?;
    Ok((spec, root))
}

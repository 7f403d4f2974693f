//! The machinery Tandem's own executors share, apart from the plugin surface
//! (`tandem-executor`) they implement: files into and out of a workspace as tar archives
//! beneath its handle ([`archive`]), supervising a block's host processes ([`process`]), the
//! kept Python interpreter ([`kept`], [`keeper`]), the channel code calls its task's tools
//! over ([`toolchannel`]), the `# filename:` directive and safe workspace paths
//! ([`workspace`]), scratch directories ([`scratch`]), who owns what a sandbox leaves
//! ([`owner`]), the files a block made ([`made`]) and the budget of open sessions
//! ([`budget`]).
#![deny(missing_docs)]

pub mod archive;
pub mod budget;
pub mod keeper;
pub mod kept;
pub mod made;
pub mod owner;
pub mod process;
pub mod scratch;
pub mod toolchannel;
pub mod workspace;

use std::path::{Path, PathBuf};

use tandem_executor::files::{ArchiveCaps, ArchivedFile};
use tandem_executor::{BoxFuture, ExecError};

pub use budget::{Budget, BudgetConfig, RegistryBudget, WITHOUT_TASK};

/// Python that every program running Python blocks puts before its own code:
/// `run_as_main(script)` (a script run as `python3 script` runs it) and what keeps the figures a
/// block shows (`plt.show()`) as `figure-N.png`. It holds no triple quotes, so it can be
/// carried in a string.
pub const PYTHON_PRELUDE: &str = include_str!("prelude.py");

/// Unpacks the tar archive at `archive` into the host directory `workspace` within `caps`:
/// what a `Session::put_archive` for a session whose workspace is that directory.
pub async fn place_archive(
    workspace: Option<PathBuf>,
    archive: PathBuf,
    caps: ArchiveCaps,
) -> Result<Vec<ArchivedFile>, ExecError> {
    place_archive_for(workspace, archive, caps, None).await
}

/// [`place_archive`], the files given to `owner` (`uid`, `gid`) when named: for a session
/// whose code runs as another user on this host's files, and must be able to change them.
pub async fn place_archive_for(
    workspace: Option<PathBuf>,
    archive: PathBuf,
    caps: ArchiveCaps,
    owner: Option<(u32, u32)>,
) -> Result<Vec<ArchivedFile>, ExecError> {
    let workspace = workspace.ok_or_else(|| ExecError::Unavailable {
        what: "placing files in this executor's sessions".to_owned(),
        hint: "it has no workspace Tandem can reach; run the task on local, docker or wasm"
            .to_owned(),
    })?;
    tokio::task::spawn_blocking(move || {
        let file = std::fs::File::open(&archive).map_err(|source| ExecError::Io {
            context: format!("reading the files to place ({})", archive.display()),
            source,
        })?;
        let read = std::io::BufReader::new(file);
        match owner {
            Some(owner) => archive::unpack_owned(&workspace, read, caps, owner),
            None => archive::unpack_into(&workspace, read, caps),
        }
        .map_err(ExecError::Files)
    })
    .await
    .map_err(|e| ExecError::Backend(format!("placing files stopped: {e}")))?
}

/// What `Session::put_archive` is for a session whose workspace is the host directory
/// `workspace`: [`place_archive`], for the session to return.
pub fn put_in_workspace(
    workspace: Option<&Path>,
    archive: &Path,
    caps: ArchiveCaps,
) -> BoxFuture<'static, Result<Vec<ArchivedFile>, ExecError>> {
    Box::pin(place_archive(
        workspace.map(Path::to_owned),
        archive.to_owned(),
        caps,
    ))
}

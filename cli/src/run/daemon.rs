//! The daemon driver: the task submitted to a daemon that answers, its files uploaded, its
//! events followed (and its blocks approved here), and what it made downloaded.

use anyhow::Result;

use super::RunArgs;
use super::end::{renderer, report_kept};
use crate::config::FileConfig;
use crate::render::PictureSource;

/// Runs the task on the daemon `client` reaches.
pub(super) async fn through_daemon(
    client: &crate::client::Client,
    args: &RunArgs,
    file: &FileConfig,
) -> Result<u8> {
    let mut spec = args.flags.daemon_spec(&args.model, args.approve, file)?;
    spec.files = crate::files::upload(client, &args.flags.files).await?;
    let id = client.submit(&spec).await?;
    let from = client.clone();
    let pictures: PictureSource = Box::new(move |_, href| from.picture(href?));
    let renderer = renderer(args.json, args.out.no_pictures, Some(pictures), None);
    let followed = crate::follow::follow_approving(client, &id, &renderer, args.approve).await?;
    let (true, Some(out)) = (followed.finished, args.out.dir()) else {
        return Ok(followed.code);
    };
    let kept = crate::keep::from_daemon(client, &id, &out, args.out.max_bytes()).await;
    let how = format!("`tandem files {id} --tar -o files.tar` fetches them all");
    Ok(report_kept(
        &renderer,
        &kept,
        args.out.out_max_mb,
        &how,
        followed.code,
    ))
}

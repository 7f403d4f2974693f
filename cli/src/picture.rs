//! Pictures shown inline in the transcript, on a terminal that speaks an image protocol:
//! kitty's graphics protocol, iTerm2's inline images (which WezTerm speaks too), or sixel.
//!
//! A picture came from a sandbox, so the terminal is never sent its bytes: it must be a PNG
//! (signature, then the size its IHDR says) that decodes within fixed bounds, and what is
//! sent is its pixels scaled to fit a box in both dimensions and encoded here. How many
//! pictures a block and a task may show, and how many bytes of escapes they may send, is
//! bounded; what is left out is said on one line.

use std::fmt::Write as _;

use base64::Engine as _;

/// Columns the box a picture is shown in is wide.
const COLUMNS: u32 = 40;
/// Rows the box a picture is shown in is high; a terminal cell is taken to be twice as high
/// as wide.
const ROWS: u32 = 20;
/// Largest width in pixels of what is sent: a larger picture is scaled down to it.
const BOX_WIDTH: u32 = 320;
/// Largest height in pixels of what is sent: a larger picture is scaled down to it.
const BOX_HEIGHT: u32 = 320;
/// Largest picture file read to be shown inline; a larger one is named only.
pub const MAX_BYTES: u64 = 8 << 20;
/// Most pixels a PNG's IHDR may say it has to be decoded; a larger one (or a decompression
/// bomb) is named only.
const MAX_PIXELS: u64 = 4096 * 4096;
/// Most bytes the PNG decoder may allocate beyond the decoded pixels.
const DECODER_BYTES: usize = 64 << 20;
/// Most pictures of one block tried (read and decoded), shown or not.
pub const BLOCK_PICTURES: u32 = 4;
/// Most bytes of escapes the pictures of one block may send.
pub const BLOCK_BYTES: usize = 2 << 20;
/// Most pictures of one task tried (read and decoded), shown or not.
pub const TASK_PICTURES: u32 = 16;
/// Most bytes of escapes the pictures of one task may send.
pub const TASK_BYTES: usize = 8 << 20;
/// Base64 characters per kitty escape, as the protocol asks.
const KITTY_CHUNK: usize = 4096;

/// An image protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// kitty's graphics protocol (kitty, Ghostty, Konsole).
    Kitty,
    /// iTerm2's inline images (iTerm2, WezTerm).
    ITerm,
    /// DEC sixel graphics (foot, mlterm, Windows Terminal, xterm built with it).
    Sixel,
}

/// A picture checked and scaled to fit the box: RGBA, 8 bits a channel.
#[derive(Debug)]
pub struct Picture {
    width: u32,
    height: u32,
    rgba: Vec<u8>,
}

/// Why a picture was not shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Refused {
    /// Not a PNG; only PNG is decoded here.
    Type,
    /// Over [`MAX_BYTES`], or gone before it was read.
    Unread,
    /// Not a PNG that decodes within [`MAX_PIXELS`].
    Broken,
    /// Over [`BLOCK_PICTURES`].
    BlockCount,
    /// Over [`BLOCK_BYTES`].
    BlockBytes,
    /// Over [`TASK_PICTURES`].
    TaskCount,
    /// Over [`TASK_BYTES`].
    TaskBytes,
}

impl Refused {
    fn says(self) -> String {
        match self {
            Self::Type => "not PNG, the only kind drawn".to_owned(),
            Self::Unread => format!("over {} MiB or gone", MAX_BYTES >> 20),
            Self::Broken => {
                let side = (MAX_PIXELS as f64).sqrt() as u64;
                format!("not a PNG that decodes within {side} x {side} pixels")
            }
            Self::BlockCount => format!("past the {BLOCK_PICTURES} a block may draw"),
            Self::BlockBytes => format!("past the {} MiB a block may draw", BLOCK_BYTES >> 20),
            Self::TaskCount => format!("past the {TASK_PICTURES} a task may draw"),
            Self::TaskBytes => format!("past the {} MiB a task may draw", TASK_BYTES >> 20),
        }
    }
}

/// What pictures a task and its current block drew, against the bounds, and what was left
/// out since it was last said.
#[derive(Debug, Default)]
pub struct Bounds {
    /// The block (turn, index) whose pictures come now.
    block: Option<(u32, u32)>,
    block_tried: u32,
    block_bytes: usize,
    task_tried: u32,
    task_bytes: usize,
    left_out: Vec<Refused>,
}

impl Bounds {
    /// The note saying what was left out, when there is one to say before the next event:
    /// a picture of `next` block (`None` for an event that is no picture) follows.
    pub fn note_before(&mut self, next: Option<(u32, u32)>) -> Option<String> {
        if self.left_out.is_empty() || (next.is_some() && next == self.block) {
            return None;
        }
        let mut why = std::mem::take(&mut self.left_out);
        why.sort();
        let n = why.len();
        let mut reasons = Vec::new();
        for chunk in why.chunk_by(|a, b| a == b) {
            reasons.push(format!("{} {}", chunk.len(), chunk[0].says()));
        }
        Some(format!(
            "{n} picture{} not drawn: {}",
            if n == 1 { "" } else { "s" },
            reasons.join("; ")
        ))
    }

    /// Counts a picture of `block` about to be read and decoded; `Err` when a count bound
    /// leaves it out.
    pub fn try_one(&mut self, block: (u32, u32)) -> Result<(), Refused> {
        if self.block != Some(block) {
            self.block = Some(block);
            self.block_tried = 0;
            self.block_bytes = 0;
        }
        if self.task_tried >= TASK_PICTURES {
            return Err(Refused::TaskCount);
        }
        if self.block_tried >= BLOCK_PICTURES {
            return Err(Refused::BlockCount);
        }
        self.block_tried += 1;
        self.task_tried += 1;
        Ok(())
    }

    /// Counts `bytes` of escapes about to be sent; `Err` when a byte bound leaves them out.
    pub fn send(&mut self, bytes: usize) -> Result<(), Refused> {
        if self.task_bytes.saturating_add(bytes) > TASK_BYTES {
            return Err(Refused::TaskBytes);
        }
        if self.block_bytes.saturating_add(bytes) > BLOCK_BYTES {
            return Err(Refused::BlockBytes);
        }
        self.block_bytes += bytes;
        self.task_bytes += bytes;
        Ok(())
    }

    /// Notes a picture left out, to be said once the block's pictures end.
    pub fn leave_out(&mut self, why: Refused) {
        self.left_out.push(why);
    }
}

impl Protocol {
    /// What `terminal` speaks: what `TANDEM_PICTURES` says (`kitty`, `iterm`, `sixel`,
    /// `none`) when set, else what the terminal says of itself.
    pub fn detect(terminal: &Terminal) -> Option<Self> {
        Self::from_env(
            &terminal.asked,
            &terminal.term,
            &terminal.program,
            &terminal.lc_terminal,
            terminal.kitty,
        )
    }

    fn from_env(asked: &str, term: &str, program: &str, lc: &str, kitty: bool) -> Option<Self> {
        match asked.trim().to_ascii_lowercase().as_str() {
            "kitty" => return Some(Self::Kitty),
            "iterm" | "iterm2" => return Some(Self::ITerm),
            "sixel" => return Some(Self::Sixel),
            "none" | "off" | "0" => return None,
            _ => {}
        }
        if kitty || term == "xterm-kitty" || term == "xterm-ghostty" || program == "ghostty" {
            Some(Self::Kitty)
        } else if program == "iTerm.app" || program == "WezTerm" || lc == "iTerm2" {
            Some(Self::ITerm)
        } else if term.starts_with("foot") || term.starts_with("mlterm") || term.contains("sixel") {
            Some(Self::Sixel)
        } else {
            None
        }
    }

    /// The bytes that show `picture` under the current line (ending on a new line), in a box
    /// of [`COLUMNS`] x [`ROWS`] cells (kitty, iTerm2) or at its checked size (sixel); `None`
    /// when it cannot be encoded. Inside tmux each escape is wrapped to pass through to the
    /// terminal (tmux's `allow-passthrough`).
    pub fn encode(self, picture: &Picture, tmux: bool) -> Option<Vec<u8>> {
        let mut escapes: Vec<String> = Vec::new();
        let (columns, rows) = cells(picture.width, picture.height);
        match self {
            Self::Kitty => {
                let b64 = base64::engine::general_purpose::STANDARD.encode(encode_png(picture)?);
                let chunks: Vec<&[u8]> = b64.as_bytes().chunks(KITTY_CHUNK).collect();
                for (i, chunk) in chunks.iter().enumerate() {
                    let more = u8::from(i + 1 < chunks.len());
                    let chunk = String::from_utf8_lossy(chunk);
                    // q=2: the terminal answers nothing, so no reply lands on stdin.
                    escapes.push(if i == 0 {
                        format!("\x1b_Gf=100,a=T,q=2,c={columns},r={rows},m={more};{chunk}\x1b\\")
                    } else {
                        format!("\x1b_Gm={more};{chunk}\x1b\\")
                    });
                }
            }
            Self::ITerm => {
                let png = encode_png(picture)?;
                escapes.push(format!(
                    "\x1b]1337;File=inline=1;size={};width={columns};height={rows};preserveAspectRatio=1:{}\x07",
                    png.len(),
                    base64::engine::general_purpose::STANDARD.encode(&png)
                ));
            }
            Self::Sixel => escapes.push(sixel(picture)?),
        }
        let mut out = Vec::with_capacity(escapes.iter().map(String::len).sum::<usize>() + 64);
        for e in escapes {
            if tmux {
                out.extend_from_slice(b"\x1bPtmux;");
                out.extend_from_slice(e.replace('\x1b', "\x1b\x1b").as_bytes());
                out.extend_from_slice(b"\x1b\\");
            } else {
                out.extend_from_slice(e.as_bytes());
            }
        }
        out.push(b'\n');
        Some(out)
    }
}

/// The cells a `width` x `height` picture is shown in: as wide as the box unless that would
/// make it higher than the box, its shape kept.
fn cells(width: u32, height: u32) -> (u32, u32) {
    let (w, h) = (u64::from(width.max(1)), u64::from(height.max(1)));
    let rows = (u64::from(COLUMNS) * h).div_ceil(2 * w);
    if rows <= u64::from(ROWS) {
        (COLUMNS, u32::try_from(rows.max(1)).unwrap_or(ROWS))
    } else {
        let columns = (u64::from(ROWS) * 2 * w / h).clamp(1, u64::from(COLUMNS));
        (u32::try_from(columns).unwrap_or(COLUMNS), ROWS)
    }
}

/// `data`, said to be of type `mime`, checked and scaled to fit [`BOX_WIDTH`] x
/// [`BOX_HEIGHT`] pixels, its shape kept: it must be a PNG whose IHDR says at most
/// [`MAX_PIXELS`] and that then decodes.
pub fn check(data: &[u8], mime: &str) -> Result<Picture, Refused> {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    if mime != "image/png" {
        return Err(Refused::Type);
    }
    if !data.starts_with(SIGNATURE) {
        return Err(Refused::Broken);
    }
    decode_scaled(data).ok_or(Refused::Broken)
}

/// The size a `width` x `height` picture is scaled to, to fit the box.
fn fit(width: u32, height: u32) -> (u32, u32) {
    if width <= BOX_WIDTH && height <= BOX_HEIGHT {
        return (width, height);
    }
    let (w, h) = (u64::from(width), u64::from(height));
    let (bw, bh) = (u64::from(BOX_WIDTH), u64::from(BOX_HEIGHT));
    let (sw, sh) = if w * bh >= h * bw {
        (bw, (h * bw / w).max(1))
    } else {
        ((w * bh / h).max(1), bh)
    };
    (
        u32::try_from(sw).unwrap_or(BOX_WIDTH),
        u32::try_from(sh).unwrap_or(BOX_HEIGHT),
    )
}

/// A PNG decoded within [`MAX_PIXELS`] and [`DECODER_BYTES`], each pixel of the picture
/// that fits the box taken from its nearest source pixel.
fn decode_scaled(data: &[u8]) -> Option<Picture> {
    use png::{ColorType, Transformations};
    let mut decoder = png::Decoder::new_with_limits(
        std::io::Cursor::new(data),
        png::Limits {
            bytes: DECODER_BYTES,
        },
    );
    decoder.set_transformations(Transformations::EXPAND | Transformations::STRIP_16);
    let mut reader = decoder.read_info().ok()?;
    let (width, height) = reader.info().size();
    if width == 0 || height == 0 || u64::from(width) * u64::from(height) > MAX_PIXELS {
        return None;
    }
    let mut buf = vec![0; reader.output_buffer_size()?];
    let frame = reader.next_frame(&mut buf).ok()?;
    let channels: usize = match frame.color_type {
        ColorType::Grayscale => 1,
        ColorType::GrayscaleAlpha => 2,
        ColorType::Rgb => 3,
        ColorType::Rgba => 4,
        ColorType::Indexed => return None,
    };
    let (w, h) = fit(width, height);
    let mut rgba = Vec::with_capacity(usize::try_from(u64::from(w) * u64::from(h) * 4).ok()?);
    for y in 0..h {
        let sy = usize::try_from(u64::from(y) * u64::from(height) / u64::from(h)).ok()?;
        let row = buf.get(sy * frame.line_size..)?;
        for x in 0..w {
            let sx = usize::try_from(u64::from(x) * u64::from(width) / u64::from(w)).ok()?;
            rgba.extend_from_slice(&match *row.get(sx * channels..(sx + 1) * channels)? {
                [g] => [g, g, g, 255],
                [g, a] => [g, g, g, a],
                [r, g, b] => [r, g, b, 255],
                [r, g, b, a] => [r, g, b, a],
                _ => return None,
            });
        }
    }
    Some(Picture {
        width: w,
        height: h,
        rgba,
    })
}

/// `picture` as a PNG made here.
fn encode_png(picture: &Picture) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, picture.width, picture.height);
    encoder.set_color(png::ColorType::Rgba);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().ok()?;
    writer.write_image_data(&picture.rgba).ok()?;
    writer.finish().ok()?;
    Some(out)
}

/// `picture` as a sixel image, in 216 colours (a 6x6x6 cube), its transparent pixels left as
/// they are.
fn sixel(picture: &Picture) -> Option<String> {
    let (w, h) = (picture.width, picture.height);
    let level = |v: u8| (u16::from(v) * 5 + 127) / 255;
    // A pixel's colour in the cube, or none where it is mostly transparent.
    let colour_at = |x: u32, y: u32| -> Option<u16> {
        let at = usize::try_from((u64::from(y) * u64::from(w) + u64::from(x)) * 4).ok()?;
        let px = picture.rgba.get(at..at + 4)?;
        (px[3] >= 128).then(|| level(px[0]) * 36 + level(px[1]) * 6 + level(px[2]))
    };
    // P2 = 1: pixels no colour sets stay as the screen was.
    let mut out = format!("\x1bP0;1q\"1;1;{w};{h}");
    for i in 0..216u16 {
        let _ = write!(
            out,
            "#{i};2;{};{};{}",
            i / 36 * 20,
            i / 6 % 6 * 20,
            i % 6 * 20
        );
    }
    let cols = usize::try_from(w).ok()?;
    for band in (0..h).step_by(6) {
        let rows = (h - band).min(6);
        let mut colours: Vec<(u16, Vec<u8>)> = Vec::new();
        for x in 0..w {
            for r in 0..rows {
                let Some(c) = colour_at(x, band + r) else {
                    continue;
                };
                let slot = match colours.iter().position(|(k, _)| *k == c) {
                    Some(slot) => slot,
                    None => {
                        colours.push((c, vec![0; cols]));
                        colours.len() - 1
                    }
                };
                colours[slot].1[x as usize] |= 1 << r;
            }
        }
        for (n, (colour, bits)) in colours.iter().enumerate() {
            if n > 0 {
                // Back to the band's start, for the next colour.
                out.push('$');
            }
            let _ = write!(out, "#{colour}");
            let mut x = 0;
            while x < bits.len() {
                let run = bits[x..].iter().take_while(|&&b| b == bits[x]).count();
                let ch = char::from(0x3f + bits[x]);
                if run > 3 {
                    let _ = write!(out, "!{run}{ch}");
                } else {
                    out.extend(std::iter::repeat_n(ch, run));
                }
                x += run;
            }
        }
        out.push('-');
    }
    out.push_str("\x1b\\");
    Some(out)
}

/// What the terminal says of itself in the environment, and what the user asked for
/// (`config::terminal` reads it).
#[derive(Debug, Default)]
pub struct Terminal {
    /// `TANDEM_PICTURES`.
    pub asked: String,
    /// `TERM`.
    pub term: String,
    /// `TERM_PROGRAM`.
    pub program: String,
    /// `LC_TERMINAL` (iTerm2 sets it, and ssh passes it on).
    pub lc_terminal: String,
    /// Whether `KITTY_WINDOW_ID` is set.
    pub kitty: bool,
    /// Whether output goes through tmux (`TMUX`), which passes an escape on only when it is
    /// wrapped.
    pub tmux: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_terminal_is_known_by_what_it_says_and_the_user_decides_first() {
        assert_eq!(
            Protocol::from_env("", "xterm-kitty", "", "", false),
            Some(Protocol::Kitty)
        );
        assert_eq!(
            Protocol::from_env("", "screen", "", "", true),
            Some(Protocol::Kitty)
        );
        assert_eq!(
            Protocol::from_env("", "xterm-256color", "iTerm.app", "", false),
            Some(Protocol::ITerm)
        );
        assert_eq!(
            Protocol::from_env("", "tmux-256color", "tmux", "iTerm2", false),
            Some(Protocol::ITerm)
        );
        assert_eq!(
            Protocol::from_env("", "xterm-256color", "", "", false),
            None
        );
        assert_eq!(
            Protocol::from_env("none", "xterm-kitty", "", "", true),
            None
        );
        assert_eq!(
            Protocol::from_env("iterm", "xterm-kitty", "", "", false),
            Some(Protocol::ITerm)
        );
    }

    /// A 2x2 PNG: red, blue on the first row, red, blue on the second.
    const PNG: &[u8] = &[
        0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44,
        0x52, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x02, 0x08, 0x02, 0x00, 0x00, 0x00, 0xfd,
        0xd4, 0x9a, 0x73, 0x00, 0x00, 0x00, 0x10, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0xf8,
        0xcf, 0x00, 0x04, 0xff, 0x19, 0x20, 0x14, 0x00, 0x1b, 0xf2, 0x03, 0xfd, 0xd6, 0x96, 0xf2,
        0x2b, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
    ];

    /// `width` x `height` RGBA pixels no two alike in a row, that compress badly.
    fn noise(width: u32, height: u32) -> Vec<u8> {
        let mut x: u32 = 0x1234_5678;
        (0..width * height * 4)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn a_kitty_picture_is_sent_in_chunks_that_read_back_whole() {
        let picture = Picture {
            width: 64,
            height: 48,
            rgba: noise(64, 48),
        };
        let out = Protocol::Kitty.encode(&picture, false).unwrap_or_default();
        let text = String::from_utf8(out).unwrap_or_default();
        assert!(
            text.starts_with("\x1b_Gf=100,a=T,q=2,c=40,r=15,m=1;"),
            "{text:.40}"
        );
        assert!(text.ends_with("\x1b\\\n"));
        let mut b64 = String::new();
        for part in text.trim_end().split("\x1b\\").filter(|p| !p.is_empty()) {
            let (_, payload) = part.split_once(';').unwrap_or_default();
            assert!(payload.len() <= KITTY_CHUNK);
            b64.push_str(payload);
        }
        let back = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap_or_default();
        let back = check(&back, "image/png").unwrap();
        assert_eq!((back.width, back.height), (64, 48));
        assert_eq!(back.rgba, picture.rgba);
        assert!(text.contains("\x1b_Gm=0;"));
    }

    #[test]
    fn a_png_is_drawn_in_sixel_pixel_by_pixel() {
        let picture = check(PNG, "image/png").unwrap();
        let out = Protocol::Sixel.encode(&picture, false).unwrap_or_default();
        let text = String::from_utf8(out).unwrap_or_default();
        assert!(
            text.starts_with("\x1bP0;1q\"1;1;2;2#0;2;0;0;0#1;2;0;0;20"),
            "{text:.60}"
        );
        // Red is colour 180 (5,0,0), blue 5 (0,0,5): each column is two pixels high, sixel
        // bits 0 and 1, `B`; red in the first column, blue in the second.
        assert!(text.ends_with("#180B?$#5?B-\x1b\\\n"), "{text}");
    }

    #[test]
    fn a_png_too_large_or_broken_is_not_drawn() {
        // A well-formed PNG that says it is 100,000 x 100,000 pixels (30 GB decoded).
        let bomb: &[u8] = &[
            0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48,
            0x44, 0x52, 0x00, 0x01, 0x86, 0xa0, 0x00, 0x01, 0x86, 0xa0, 0x08, 0x02, 0x00, 0x00,
            0x00, 0x27, 0x30, 0x9c, 0x9f, 0x00, 0x00, 0x00, 0x08, 0x49, 0x44, 0x41, 0x54, 0x78,
            0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01, 0x48, 0x06, 0x89, 0xd2, 0x00, 0x00, 0x00,
            0x00, 0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
        ];
        assert_eq!(check(bomb, "image/png").err(), Some(Refused::Broken));
        assert_eq!(
            check(b"not a png", "image/png").err(),
            Some(Refused::Broken)
        );
        // The signature alone is not enough.
        assert_eq!(check(&PNG[..40], "image/png").err(), Some(Refused::Broken));
        assert_eq!(check(PNG, "image/jpeg").err(), Some(Refused::Type));
        assert_eq!(
            Protocol::from_env("", "foot", "", "", false),
            Some(Protocol::Sixel)
        );
    }

    #[test]
    fn inside_tmux_every_escape_is_wrapped_with_its_escapes_doubled() {
        let picture = check(PNG, "image/png").unwrap();
        let out = Protocol::ITerm.encode(&picture, true).unwrap_or_default();
        let text = String::from_utf8(out).unwrap_or_default();
        assert!(
            text.starts_with("\x1bPtmux;\x1b\x1b]1337;File=inline=1;size="),
            "{text}"
        );
        assert!(
            text.contains(";width=40;height=20;preserveAspectRatio=1:iVBORw0KGgo"),
            "{text}"
        );
        assert!(text.ends_with("\x07\x1b\\\n"), "{text}");
        assert_eq!(text.matches('\x1b').count(), 4, "{text}");
    }

    #[test]
    fn a_picture_is_scaled_to_fit_the_box_in_both_dimensions_and_its_cells_too() {
        assert_eq!(fit(2, 2), (2, 2));
        assert_eq!(fit(640, 480), (320, 240));
        assert_eq!(fit(480, 640), (240, 320));
        assert_eq!(fit(1, 16_777_216), (1, 320));
        assert_eq!(fit(16_777_216, 1), (320, 1));
        assert_eq!(cells(2, 2), (40, 20));
        assert_eq!(cells(320, 240), (40, 15));
        assert_eq!(cells(240, 320), (30, 20));
        assert_eq!(cells(1, 320), (1, 20));
        assert_eq!(cells(320, 1), (40, 1));
    }

    #[test]
    fn the_bounds_count_pictures_and_bytes_per_block_and_per_task() {
        let mut b = Bounds::default();
        for _ in 0..BLOCK_PICTURES {
            assert_eq!(b.try_one((1, 1)), Ok(()));
        }
        assert_eq!(b.try_one((1, 1)), Err(Refused::BlockCount));
        b.leave_out(Refused::BlockCount);
        // Said once the block's pictures end, not before.
        assert_eq!(b.note_before(Some((1, 1))), None);
        assert_eq!(
            b.note_before(None).as_deref(),
            Some("1 picture not drawn: 1 past the 4 a block may draw")
        );
        assert_eq!(b.note_before(None), None);
        assert_eq!(b.try_one((1, 2)), Ok(()));
        assert_eq!(b.send(BLOCK_BYTES), Ok(()));
        assert_eq!(b.send(1), Err(Refused::BlockBytes));
        for block in 3..6 {
            assert_eq!(b.try_one((1, block)), Ok(()));
            assert_eq!(b.send(BLOCK_BYTES), Ok(()));
        }
        assert_eq!(b.try_one((1, 6)), Ok(()));
        assert_eq!(b.send(1), Err(Refused::TaskBytes));
        for block in 7..20 {
            let _ = b.try_one((1, block));
        }
        assert_eq!(b.try_one((2, 1)), Err(Refused::TaskCount));
    }
}

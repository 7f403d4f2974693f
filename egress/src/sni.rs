//! The server name a TLS ClientHello asks for, read without trusting a single length in it.

/// Bytes of one TLS record's header.
pub const RECORD_HEADER: usize = 5;
/// The largest TLS plaintext record.
pub const MAX_RECORD: usize = 16_384 + 2048;

/// What the first record of a tunnel says.
#[derive(Debug, PartialEq, Eq)]
pub enum Hello {
    /// A ClientHello naming this server (lower case).
    Named(String),
    /// A ClientHello with no server name.
    Unnamed,
    /// Not a TLS ClientHello at all, or one cut or malformed.
    NotTls(&'static str),
}

/// The length of the record that `head` (at least five bytes) starts, header included.
pub fn record_len(head: &[u8]) -> Option<usize> {
    match head {
        [0x16, 0x03, _, hi, lo, ..] => {
            Some(RECORD_HEADER + usize::from(*hi) * 256 + usize::from(*lo))
        }
        _ => None,
    }
}

/// Reads the server name from one whole handshake record holding a ClientHello.
pub fn server_name(record: &[u8]) -> Hello {
    match parse(record) {
        Ok(Some(name)) => Hello::Named(name),
        Ok(None) => Hello::Unnamed,
        Err(why) => Hello::NotTls(why),
    }
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.rest.len() < n {
            return Err("a ClientHello cut short");
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<usize, &'static str> {
        Ok(usize::from(self.take(1)?[0]))
    }

    fn u16(&mut self) -> Result<usize, &'static str> {
        let b = self.take(2)?;
        Ok(usize::from(b[0]) * 256 + usize::from(b[1]))
    }

    fn u24(&mut self) -> Result<usize, &'static str> {
        let b = self.take(3)?;
        Ok(usize::from(b[0]) * 65_536 + usize::from(b[1]) * 256 + usize::from(b[2]))
    }

    fn sub(&mut self, n: usize) -> Result<Reader<'a>, &'static str> {
        Ok(Reader {
            rest: self.take(n)?,
        })
    }
}

fn parse(record: &[u8]) -> Result<Option<String>, &'static str> {
    let mut r = Reader { rest: record };
    if r.u8()? != 0x16 {
        return Err("not a TLS handshake");
    }
    r.take(2)?;
    let len = r.u16()?;
    let mut body = r.sub(len)?;
    if body.u8()? != 1 {
        return Err("not a ClientHello");
    }
    let len = body.u24()?;
    let mut hello = body
        .sub(len)
        .map_err(|_| "a ClientHello split across records")?;
    hello.take(2 + 32)?;
    let n = hello.u8()?;
    hello.take(n)?;
    let n = hello.u16()?;
    hello.take(n)?;
    let n = hello.u8()?;
    hello.take(n)?;
    if hello.rest.is_empty() {
        return Ok(None);
    }
    let n = hello.u16()?;
    let mut exts = hello.sub(n)?;
    let mut found = None;
    while !exts.rest.is_empty() {
        let kind = exts.u16()?;
        let n = exts.u16()?;
        let mut ext = exts.sub(n)?;
        if kind != 0 {
            continue;
        }
        if found.is_some() {
            return Err("two server_name extensions");
        }
        let n = ext.u16()?;
        let mut list = ext.sub(n)?;
        while !list.rest.is_empty() {
            let name_type = list.u8()?;
            let n = list.u16()?;
            let name = list.take(n)?;
            if name_type != 0 {
                continue;
            }
            if found.is_some() {
                return Err("two host names in server_name");
            }
            let name = std::str::from_utf8(name).map_err(|_| "a server name that is not text")?;
            found = Some(name.trim_end_matches('.').to_ascii_lowercase());
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ClientHello record naming `name`, built by hand.
    pub(crate) fn hello(name: Option<&str>) -> Vec<u8> {
        let mut exts = Vec::new();
        if let Some(name) = name {
            let n = name.len();
            let mut list = vec![0u8];
            list.extend_from_slice(&(n as u16).to_be_bytes());
            list.extend_from_slice(name.as_bytes());
            let mut sni = (list.len() as u16).to_be_bytes().to_vec();
            sni.extend_from_slice(&list);
            exts.extend_from_slice(&[0, 0]);
            exts.extend_from_slice(&(sni.len() as u16).to_be_bytes());
            exts.extend_from_slice(&sni);
        }
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0);
        body.extend_from_slice(&[0, 2, 0x13, 0x01]);
        body.extend_from_slice(&[1, 0]);
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![1, 0];
        hs.extend_from_slice(&(body.len() as u16).to_be_bytes());
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn reads_the_name_and_refuses_what_is_not_a_hello() {
        assert_eq!(
            server_name(&hello(Some("Files.Test"))),
            Hello::Named("files.test".into())
        );
        assert_eq!(server_name(&hello(None)), Hello::Unnamed);
        assert_eq!(record_len(&hello(None)), Some(hello(None).len()));
        assert!(matches!(
            server_name(b"GET / HTTP/1.1\r\n"),
            Hello::NotTls(_)
        ));
        let whole = hello(Some("a.test"));
        for cut in 0..whole.len() {
            assert!(
                matches!(server_name(&whole[..cut]), Hello::NotTls(_)),
                "{cut}"
            );
        }
    }
}

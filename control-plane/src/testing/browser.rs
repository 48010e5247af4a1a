//! A real browser for the console's tests: Debian's headless Chromium driven over W3C WebDriver
//! by its `chromedriver` (both installed by `cargo xtask setup`). The client speaks HTTP/1.1 to
//! the driver on the loopback, one request per connection (`Connection: close`; the driver
//! answers with a length), so it needs nothing but std and serde_json: `cargo xtask demo`
//! includes this file too (`#[path]`) for its screenshots. The driver runs in a process group of
//! its own, which holds the browser too; the group is killed when the [`Browser`] is dropped.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const CHROMIUM: &str = "/usr/bin/chromium";
const DRIVER: &str = "/usr/bin/chromedriver";
/// The key of an element reference in WebDriver's answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// One browser session (its own profile, so its own cookies).
#[derive(Debug)]
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    /// The session's own directory, removed on drop: Chromium's profile (`profile/`) and the
    /// driver's and browser's temp directory (`tmp/`, their `TMPDIR`), so that what they leave
    /// there when killed goes with it (Chromium's `org.chromium.Chromium.scoped_dir.*`).
    dir: std::path::PathBuf,
}

/// An element of the page, by the driver's reference.
#[derive(Debug, Clone)]
pub struct Element(String);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Browser {
    /// Starts chromedriver and a headless Chromium at 1280×800 that accepts the test CA's
    /// certificates. Fails loudly when the browser is not installed.
    pub fn start() -> Browser {
        for path in [CHROMIUM, DRIVER] {
            assert!(
                std::path::Path::new(path).exists(),
                "{path} is missing: the console tests need Debian's chromium and chromium-driver (run `cargo xtask setup`)"
            );
        }
        let port = free_port();
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let dir = std::env::temp_dir().join(format!("iw-chromium-{}-{port}-{nanos}", std::process::id()));
        std::fs::create_dir_all(dir.join("tmp")).expect("creating the browser's directory");
        let driver = Command::new(DRIVER)
            .arg(format!("--port={port}"))
            .env("TMPDIR", dir.join("tmp"))
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting chromedriver");
        let mut browser = Browser { driver, port, session: String::new(), dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "chromedriver never listened on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        let created = browser.call(
            "POST",
            "/session",
            Some(json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "acceptInsecureCerts": true,
                "goog:chromeOptions": {
                    "binary": CHROMIUM,
                    "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,800",
                             "--disable-dev-shm-usage", "--disable-crash-reporter", "--disable-breakpad", format!("--user-data-dir={}", browser.dir.join("profile").display())],
                },
            }}})),
        );
        browser.session =
            created["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {created}")).to_owned();
        browser
    }

    /// One WebDriver command; its `value`. An error answer panics with the driver's message.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).expect("connecting to chromedriver");
        stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).unwrap();
        // The driver may keep the connection open after its answer: read the head, then as
        // many bytes as it says the body has.
        let mut answer = Vec::new();
        let mut buf = [0u8; 8192];
        let (head, body) = loop {
            let n = stream.read(&mut buf).unwrap();
            assert!(n > 0, "chromedriver closed without an answer to {method} {path}");
            answer.extend_from_slice(&buf[..n]);
            if let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&answer[..end]).into_owned();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("content-length")))
                    .map(|(_, v)| v.trim().parse().unwrap())
                    .unwrap_or_else(|| panic!("no Content-Length: {head}"));
                let mut body = answer[end + 4..].to_vec();
                while body.len() < length {
                    let n = stream.read(&mut buf).unwrap();
                    assert!(n > 0, "chromedriver closed in the middle of its answer to {method} {path}");
                    body.extend_from_slice(&buf[..n]);
                }
                break (head, String::from_utf8(body).unwrap());
            }
        };
        let parsed: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {head}\n{body}"));
        let ok = head.split(' ').nth(1).is_some_and(|code| code.starts_with('2'));
        assert!(ok, "WebDriver {method} {path}: {head}\n{parsed}");
        parsed["value"].clone()
    }

    fn at(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    pub fn goto(&self, url: &str) {
        self.call("POST", &self.at("/url"), Some(json!({"url": url})));
    }

    pub fn url(&self) -> String {
        self.call("GET", &self.at("/url"), None).as_str().unwrap().to_owned()
    }

    /// The page's text as a person reads it.
    pub fn text(&self) -> String {
        self.script("return document.body.innerText;", json!([])).as_str().unwrap_or_default().to_owned()
    }

    /// Waits (polling every 50 ms, up to 15 s) until the page shows `text`, or its URL ends with
    /// it when `text` starts with `/`; panics naming what it saw.
    pub fn wait_for(&self, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let seen = match text.starts_with('/') {
                true => self.url(),
                false => self.text(),
            };
            let done = match text.starts_with('/') {
                true => seen.ends_with(text),
                false => seen.contains(text),
            };
            if done {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "waited 15 s for {text:?}; the page is {}:\n{seen}",
                self.url()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every element `css` selects.
    pub fn all(&self, css: &str) -> Vec<Element> {
        let found =
            self.call("POST", &self.at("/elements"), Some(json!({"using": "css selector", "value": css})));
        found.as_array().unwrap().iter().map(|e| Element(e[ELEMENT].as_str().unwrap().to_owned())).collect()
    }

    /// The one element `css` selects.
    pub fn one(&self, css: &str) -> Element {
        let all = self.all(css);
        assert_eq!(all.len(), 1, "{css} selects {} elements on {}", all.len(), self.url());
        all.into_iter().next().unwrap()
    }

    pub fn type_into(&self, element: &Element, text: &str) {
        self.call("POST", &self.at(&format!("/element/{}/value", element.0)), Some(json!({"text": text})));
    }

    pub fn clear(&self, element: &Element) {
        self.call("POST", &self.at(&format!("/element/{}/clear", element.0)), Some(json!({})));
    }

    pub fn click(&self, element: &Element) {
        self.call("POST", &self.at(&format!("/element/{}/click", element.0)), Some(json!({})));
    }

    pub fn attribute(&self, element: &Element, name: &str) -> Option<String> {
        self.call("GET", &self.at(&format!("/element/{}/attribute/{name}", element.0)), None)
            .as_str()
            .map(str::to_owned)
    }

    /// Runs `script` in the page (synchronously; a returned promise is awaited) with `args`.
    pub fn script(&self, script: &str, args: Value) -> Value {
        self.call("POST", &self.at("/execute/sync"), Some(json!({"script": script, "args": args})))
    }

    /// Saves what the window shows as a PNG at `path`.
    pub fn screenshot(&self, path: &std::path::Path) {
        let png = self.call("GET", &self.at("/screenshot"), None);
        let bytes = base64_decode(png.as_str().unwrap());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.call("DELETE", &format!("/session/{}", self.session), None)
            }));
        }
        // The driver's process group (it leads it): the driver and every browser process.
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", self.driver.id())]).status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        // The killed browser's processes may still be exiting, and a last one may write into its
        // directory while it goes: try again until the directory is gone (a few tries at most).
        for _ in 0..20 {
            if std::fs::remove_dir_all(&self.dir).is_ok() || !self.dir.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Standard base64 (the driver's screenshots), ignoring padding and line breaks.
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let sextets: Vec<u8> = text.bytes().filter_map(value).collect();
    let mut out = Vec::with_capacity(sextets.len() * 3 / 4);
    for chunk in sextets.chunks(4) {
        let n = chunk.iter().enumerate().fold(0u32, |acc, (i, s)| acc | (u32::from(*s) << (18 - 6 * i)));
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..chunk.len().saturating_sub(1)]);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_decodes_as_the_standard_says() {
        assert_eq!(super::base64_decode("aGVsbG8="), b"hello");
        assert_eq!(super::base64_decode("aGVsbG8h"), b"hello!");
        assert_eq!(super::base64_decode("aGk="), b"hi");
        assert_eq!(super::base64_decode("/+8A"), [0xff, 0xef, 0x00]);
    }
}

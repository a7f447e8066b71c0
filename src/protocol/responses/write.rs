//! JSON written a field at a time, for the objects a Responses translation writes on every
//! call (the `response`, its items and usage).
//!
//! `serde_json` writes each key of a derived struct through its string escaper, a byte at a
//! time; for a `response` (27 keys, and more in its items and usage) that was most of what
//! writing one cost. Here keys, fixed names that need no escaping, are copied as they are, and
//! only values (strings from the request or the provider, numbers) go through `serde_json`.

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;

/// `run` (fixed JSON, ending where a value goes), then `plain` as a string: a text of ASCII
/// letters, digits and `_` (an id the gateway made, see [`Ids`](super::Ids), or a status's
/// name), which needs no escaping.
#[inline(always)]
pub(super) fn write_plain(run: &[u8], plain: &str, out: &mut Vec<u8>) {
    debug_assert!(
        plain
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_'),
        "not an id or a name the gateway made: {plain}"
    );
    out.extend_from_slice(run);
    out.push(b'"');
    out.extend_from_slice(plain.as_bytes());
    out.push(b'"');
}

/// Something written as JSON by [`ObjectWriter`]s.
pub(super) trait WriteJson {
    fn write_json(&self, out: &mut Vec<u8>);
}

impl WriteJson for Value {
    fn write_json(&self, out: &mut Vec<u8>) {
        serde_json::to_writer(out, self).expect("a JSON value serialises");
    }
}

/// A value as the client wrote it, line breaks aside: what is written may go into a
/// server-sent event's `data:` line, which must not hold one, so a value with a line break (a
/// pretty-printed schema, say; inside a JSON string one is always escaped) is written compact.
impl WriteJson for RawValue {
    fn write_json(&self, out: &mut Vec<u8>) {
        let text = self.get().as_bytes();
        if memchr::memchr2(b'\n', b'\r', text).is_none() {
            out.extend_from_slice(text);
        } else {
            let value: Value = serde_json::from_slice(text).expect("a raw value is JSON");
            value.write_json(out);
        }
    }
}

impl WriteJson for str {
    fn write_json(&self, out: &mut Vec<u8>) {
        serde_json::to_writer(out, self).expect("a string serialises");
    }
}

/// A text a translation writes, as `serde_json` read it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Str<'a> {
    Read(&'a str),
    /// Read from JSON where it held no escape: nothing in it needs one (a JSON string holds no
    /// raw quote or control character), so it is copied between quotes.
    Unescaped(&'a str),
}

impl<'a> Str<'a> {
    pub(super) fn is_empty(self) -> bool {
        match self {
            Str::Read(text) | Str::Unescaped(text) => text.is_empty(),
        }
    }
}

impl<'a> From<&'a str> for Str<'a> {
    fn from(text: &'a str) -> Str<'a> {
        Str::Read(text)
    }
}

impl WriteJson for Str<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        match self {
            Str::Read(text) => text.write_json(out),
            Str::Unescaped(text) => {
                debug_assert!(
                    !text.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20),
                    "{text:?} needs escapes"
                );
                out.push(b'"');
                out.extend_from_slice(text.as_bytes());
                out.push(b'"');
            }
        }
    }
}

/// A value from a request: parsed, or as the client wrote it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Json<'a> {
    Value(&'a Value),
    Raw(&'a RawValue),
}

impl Json<'_> {
    pub(super) fn is_null(self) -> bool {
        match self {
            Json::Value(value) => value.is_null(),
            Json::Raw(raw) => raw.get() == "null",
        }
    }
}

impl WriteJson for Json<'_> {
    fn write_json(&self, out: &mut Vec<u8>) {
        match self {
            Json::Value(value) => value.write_json(out),
            Json::Raw(raw) => raw.write_json(out),
        }
    }
}

impl<T: WriteJson + ?Sized> WriteJson for &T {
    fn write_json(&self, out: &mut Vec<u8>) {
        (**self).write_json(out);
    }
}

impl<T: WriteJson> WriteJson for Option<T> {
    fn write_json(&self, out: &mut Vec<u8>) {
        match self {
            Some(value) => value.write_json(out),
            None => out.extend_from_slice(b"null"),
        }
    }
}

impl<T: WriteJson> WriteJson for [T] {
    fn write_json(&self, out: &mut Vec<u8>) {
        out.push(b'[');
        for (index, value) in self.iter().enumerate() {
            if index > 0 {
                out.push(b',');
            }
            value.write_json(out);
        }
        out.push(b']');
    }
}

/// `value` as a `serde_json::Value`, to check what is written.
#[cfg(test)]
pub(super) fn to_value(value: &(impl WriteJson + ?Sized)) -> Value {
    let mut json = Vec::with_capacity(256);
    value.write_json(&mut json);
    serde_json::from_slice(&json).expect("what is written is JSON")
}

/// A JSON object being written into a buffer; [`close`](ObjectWriter::close) ends it.
pub(super) struct ObjectWriter<'w> {
    out: &'w mut Vec<u8>,
    empty: bool,
}

impl<'w> ObjectWriter<'w> {
    pub(super) fn open(out: &'w mut Vec<u8>) -> ObjectWriter<'w> {
        out.push(b'{');
        ObjectWriter { out, empty: true }
    }

    // Inlined where the key is a literal, its copy is a few moves rather than a call to
    // `memcpy` (a translated reply 1.27-1.29 µs before, 1.22-1.24 µs after; criterion).
    #[inline(always)]
    fn key(&mut self, key: &'static str) {
        debug_assert!(
            key.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\'),
            "a key that needs escaping: {key}"
        );
        if !self.empty {
            self.out.push(b',');
        }
        self.empty = false;
        self.out.push(b'"');
        self.out.extend_from_slice(key.as_bytes());
        self.out.extend_from_slice(b"\":");
    }

    /// A field whose value is the JSON text `json`, as it is.
    #[inline(always)]
    pub(super) fn raw(&mut self, key: &'static str, json: &'static str) {
        self.key(key);
        self.out.extend_from_slice(json.as_bytes());
    }

    /// A field whose value serde writes (a string, a number, a `Value`).
    #[inline(always)]
    pub(super) fn field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) {
        self.key(key);
        serde_json::to_writer(&mut *self.out, value).expect("a value serialises");
    }

    /// A field whose value writes itself.
    /// An id the gateway made (see [`Ids`](super::Ids)): ASCII letters, digits and `_`, which
    /// need no escaping.
    #[inline(always)]
    pub(super) fn id(&mut self, key: &'static str, id: &str) {
        self.key(key);
        write_plain(b"", id, self.out);
    }

    #[inline(always)]
    pub(super) fn write<T: WriteJson + ?Sized>(&mut self, key: &'static str, value: &T) {
        self.key(key);
        value.write_json(self.out);
    }

    /// The fields whose values are given, in order; those left `None` are not written.
    pub(super) fn write_given<'v, T: WriteJson + ?Sized + 'v>(
        &mut self,
        fields: impl IntoIterator<Item = (&'static str, Option<&'v T>)>,
    ) {
        for (key, value) in fields {
            if let Some(value) = value {
                self.write(key, value);
            }
        }
    }

    /// A field whose value `write` appends.
    pub(super) fn write_with(&mut self, key: &'static str, write: impl FnOnce(&mut Vec<u8>)) {
        self.key(key);
        write(self.out);
    }

    /// A field whose value is an object, written (and closed) through the writer returned.
    pub(super) fn object(&mut self, key: &'static str) -> ObjectWriter<'_> {
        self.key(key);
        ObjectWriter::open(self.out)
    }

    pub(super) fn close(self) {
        self.out.push(b'}');
    }
}

/// The keys of every object in `json`, in order, duplicates kept (a `Value` keeps only the
/// last of a duplicated key, so comparing values would not see one written twice).
#[cfg(test)]
pub(super) fn keys_of_every_object(json: &[u8]) -> Vec<Vec<String>> {
    struct Seed<'s>(&'s mut Vec<Vec<String>>);
    impl<'de> serde::de::DeserializeSeed<'de> for Seed<'_> {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> serde::de::Visitor<'de> for Seed<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_map<M: serde::de::MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
            let at = self.0.len();
            self.0.push(Vec::new());
            while let Some(key) = map.next_key::<String>()? {
                self.0[at].push(key);
                map.next_value_seed(Seed(self.0))?;
            }
            Ok(())
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while seq.next_element_seed(Seed(self.0))?.is_some() {}
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
    }
    let mut objects = Vec::new();
    let mut de = serde_json::Deserializer::from_slice(json);
    serde::de::DeserializeSeed::deserialize(Seed(&mut objects), &mut de).expect("JSON");
    objects
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    struct Point(i64, Option<&'static str>);

    impl WriteJson for Point {
        fn write_json(&self, out: &mut Vec<u8>) {
            let mut point = ObjectWriter::open(out);
            point.raw("kind", r#""point""#);
            point.field("x", &self.0);
            point.field("label", &self.1);
            let mut empty = point.object("tags");
            empty.raw("none", "[]");
            empty.close();
            point.close();
        }
    }

    #[test]
    fn objects_are_written_with_their_keys_as_given_and_their_values_escaped() {
        let points = [Point(1, Some("a \"quoted\"\nline")), Point(-2, None)];
        let mut out = Vec::new();
        let mut list = ObjectWriter::open(&mut out);
        list.write("points", &points[..]);
        list.write("first", &Some(Point(3, None)));
        list.write("absent", &None::<Point>);
        list.close();
        let written: Value = serde_json::from_slice(&out).expect("JSON");
        assert_eq!(
            written,
            json!({
                "points": [
                    { "kind": "point", "x": 1, "label": "a \"quoted\"\nline", "tags": { "none": [] } },
                    { "kind": "point", "x": -2, "label": null, "tags": { "none": [] } },
                ],
                "first": { "kind": "point", "x": 3, "label": null, "tags": { "none": [] } },
                "absent": null,
            })
        );
        assert_eq!(to_value(&points[1])["x"], -2);
    }
}

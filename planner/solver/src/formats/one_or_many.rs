//! A list written as its one element when it has one, as an array otherwise: a field that held
//! one value in documents written before it could hold several (a block's selective terms, a
//! plan's selective modules under one policy) reads either way, and a document with one value
//! is written as before, so older readers and committed documents see no change.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    Many(Vec<T>),
    One(T),
}

pub fn serialize<T: Serialize, S: Serializer>(v: &[T], s: S) -> Result<S::Ok, S::Error> {
    match v {
        [one] => one.serialize(s),
        many => many.serialize(s),
    }
}

pub fn deserialize<'de, T: DeserializeOwned, D: Deserializer<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::Many(v) => v,
        OneOrMany::One(one) => vec![one],
    })
}

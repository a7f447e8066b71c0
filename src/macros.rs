//! The crate's one macro: a named future around a boxed one.

/// Declares `pub struct $name<T>`, a future of `T` that is a boxed future inside, so that a
/// service's `Future` type has a name of its own and the public API never shows
/// `Pin<Box<dyn Future>>` (axum's `opaque_future!` does the same). The box can later give way
/// to a state machine without a breaking release.
macro_rules! response_future {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        pub struct $name<T> {
            inner: std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>,
        }

        impl<T> $name<T> {
            pub(crate) fn new(future: impl std::future::Future<Output = T> + Send + 'static) -> Self {
                $name {
                    inner: Box::pin(future),
                }
            }
        }

        impl<T> std::future::Future for $name<T> {
            type Output = T;

            fn poll(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<T> {
                self.inner.as_mut().poll(cx)
            }
        }

        impl<T> std::fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name)).finish_non_exhaustive()
            }
        }
    };
}

pub(crate) use response_future;

"""huggingface_hub's errors as the Hub's answers raise them, for the tests of what the download
makes of them (hub/hf_errors, hub/hub_client)."""
from __future__ import annotations


def http_error(cls_name, status, message="boom"):
    """huggingface_hub.errors.<cls_name> for an HTTP answer with this status."""
    import httpx2
    from huggingface_hub import errors
    response = httpx2.Response(status, request=httpx2.Request("GET", "http://hub/x"))
    return getattr(errors, cls_name)(message, response=response)


def local_entry_error_from(inner):
    """What huggingface_hub raises when a download fails and the cache has nothing either: a
    LocalEntryNotFoundError whose cause (__cause__) is ``inner``."""
    from huggingface_hub import errors
    try:
        try:
            raise inner
        except Exception as exc:
            raise errors.LocalEntryNotFoundError("cannot find the requested files") from exc
    except errors.LocalEntryNotFoundError as outer:
        return outer

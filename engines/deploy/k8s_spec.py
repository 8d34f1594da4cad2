"""The ``kubernetes:`` section of a fleet file (``kvgate deploy render --target k8s|helm``).

Only names of Secrets are ever written here: credentials live in Kubernetes Secrets that the
operator creates (docs/kubernetes.md), and the manifests reference them (``secretKeyRef`` or a
mounted Secret), never inline a value.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_STRICT = ConfigDict(extra="forbid", frozen=True)
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class SecretRef(BaseModel):
    """One key of a Kubernetes Secret."""

    model_config = _STRICT
    name: str = Field(pattern=_DNS_LABEL, max_length=63)
    key: str = Field(min_length=1, pattern=r"^[-._a-zA-Z0-9]+$")


class KubernetesSpec(BaseModel):
    model_config = _STRICT
    namespace: str = Field("kvgate", pattern=_DNS_LABEL, max_length=63)
    #: Render a Namespace object (off when the namespace is managed elsewhere).
    create_namespace: bool = True
    #: An image with kvgate installed (``pip install kvgate``; docs/kubernetes.md).
    gateway_image: str = "kvgate:latest"
    engine_image: str = "vllm/vllm-openai:latest"
    #: The Mooncake master's image (``mooncake_master`` from ``mooncake-transfer-engine``);
    #: default: the engine image (vLLM images with Mooncake carry it).
    mooncake_image: str | None = None
    redis_image: str = "redis:7.4-alpine"
    gateway_replicas: int = Field(2, ge=1)
    #: HPA ceiling; equal to ``gateway_replicas``: no HPA is rendered.
    gateway_max_replicas: int = Field(6, ge=1)
    #: HPA target: requests per second per gateway pod (``kvgate_requests_per_second``, a
    #: metrics-adapter rule over ``kvgate_requests_total``). 50: a gateway pod proxies far
    #: more, but a lower target scales out before one pod's event loop is the bottleneck.
    hpa_requests_per_second: int = Field(50, ge=1)
    #: ``in-cluster``: a one-pod Redis StatefulSet (for trials; production: a managed Redis,
    #: ``external``, its URL from ``redis_secret``); ``none``: one gateway replica only.
    redis: Literal["in-cluster", "external", "none"] = "in-cluster"
    redis_secret: SecretRef = SecretRef(name="kvgate-redis", key="url")
    #: ``KVGATE_SECRET`` (optional Secret: with Redis the replicas share one automatically).
    secret: SecretRef = SecretRef(name="kvgate-secret", key="secret")
    #: A Secret holding ``keys.yaml`` (``kvgate keys create``), mounted read-only and given as
    #: ``--keys``; none: auth off.
    keys_secret: str | None = Field("kvgate-keys", pattern=_DNS_LABEL, max_length=63)
    #: Provider credentials: environment variable (a provider's ``api_key_env``) -> Secret key.
    provider_keys: dict[str, SecretRef] = Field(default_factory=dict)
    #: Hugging Face token for gated models (optional Secret).
    hf_token: SecretRef | None = SecretRef(name="hf-token", key="token")
    #: ``/dev/shm`` of each engine pod (vLLM's NCCL/tensor-parallel workers need it).
    engine_shm: str = "16Gi"

    @model_validator(mode="after")
    def _check(self) -> KubernetesSpec:
        if self.gateway_max_replicas < self.gateway_replicas:
            raise ValueError("gateway_max_replicas must be >= gateway_replicas")
        if self.redis == "none" and self.gateway_max_replicas > 1:
            raise ValueError("several gateway replicas share state through Redis: "
                             "redis: none needs gateway_replicas = gateway_max_replicas = 1")
        return self

{{/* One engine role (prefill or decode): its `tandem serve` arguments and its pod template.
Called with (dict "root" $ "component" "prefill"|"decode"), plus "node" "leader"|"worker" for the pods
of a LeaderWorkerSet (the role's nodes > 1: one TP group over `nodes` pods, engine-leaderworkerset.yaml). */}}

{{- define "tandem.engine.nodes" -}}
{{- int ((index .root.Values .component).nodes | default 1) -}}
{{- end -}}

{{- define "tandem.engine.isWorker" -}}
{{- if eq (.node | default "") "worker" }}true{{ end -}}
{{- end -}}

{{- define "tandem.engine.args" -}}
{{- $v := .root.Values -}}
{{- $role := index $v .component -}}
- serve
- --disaggregation-mode
- {{ .component }}
- --host
- 0.0.0.0
- --port
- {{ $v.engine.port | quote }}
- --device
- {{ $v.device }}
- --model
- {{ include "tandem.model.arg" .root | quote }}
{{- $hfId := ternary ($v.model.hf.id | default "") "" (eq $v.model.source "hf") }}
{{- with (default $hfId $v.model.servedModelName) }}
- --served-model-name
- {{ . | quote }}
{{- end }}
{{ include "tandem.transfer.args" .root }}
{{- $flips := and $v.planner.enabled (eq $v.planner.actuator "flip") }}
{{- if $flips }}
- --enable-pd-role-switch
{{- end }}
{{- if or (eq .component "prefill") $flips }}
- --bootstrap-port
- {{ $v.bootstrap.port | quote }}
{{- if $v.bootstrap.standalone.enabled }}
- --bootstrap-url
- {{ printf "%s://%s:%d" (include "tandem.scheme" .root) (include "tandem.serviceHost" (dict "root" .root "component" "bootstrap")) (int $v.bootstrap.port) }}
{{- end }}
{{- end }}
{{- if gt (int ($role.tpSize | default 1)) 1 }}
- --tp-size
- {{ $role.tpSize | quote }}
{{- end }}
{{- if gt (int ($role.dpSize | default 1)) 1 }}
- --enable-dp-attention
- --dp-size
- {{ $role.dpSize | quote }}
{{- end }}
{{- if gt (int ($role.epSize | default 1)) 1 }}
- --ep-size
- {{ $role.epSize | quote }}
{{- end }}
{{- $nodes := int (include "tandem.engine.nodes" .) }}
{{- if gt $nodes 1 }}
- --nnodes
- {{ $nodes | quote }}
- --node-rank
- {{ ternary "$(LWS_WORKER_INDEX)" "0" (eq (include "tandem.engine.isWorker" .) "true") | quote }}
- --dist-init-addr
- {{ printf "$(LWS_LEADER_ADDRESS):%d" (int $v.engine.distInitPort) | quote }}
{{- end }}
- --drain-timeout-s
- {{ $v.drain.timeoutSeconds | quote }}
{{- include "tandem.engine.kvStoreArgs" .root }}
{{- include "tandem.lora.args" .root }}
{{- include "tandem.tls.args" (dict "root" .root) }}
{{- range concat $v.engine.extraArgs $role.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* With kvStore.enabled: the host tier and the KV store behind it, the chart's kv-store Service. */}}
{{- define "tandem.engine.kvStoreArgs" -}}
{{- $k := .Values.kvStore -}}
{{- if $k.enabled }}
{{- $host := include "tandem.serviceHost" (dict "root" . "component" "kv-store") }}
{{- $extra := dict "master_server_address" (printf "%s:%d" $host (int $k.port)) "metadata_server" (printf "http://%s:%d/metadata" $host (int $k.metadataPort)) }}
- --enable-hierarchical-cache
- --hicache-storage-backend
- mooncake
- --hicache-storage-backend-extra-config
- {{ toJson $extra | quote }}
- --hicache-storage-prefetch-policy
- {{ $k.prefetchPolicy }}
{{- end }}
{{- end -}}

{{/* TANDEM_ADVERTISE_HOST: peers (the decode's control messages, the prefill's KV writes) reach this
pod at its own address. TANDEM_API_KEY: the router's key, which it sends on every call. */}}
{{- define "tandem.engine.env" -}}
{{- $v := .root.Values -}}
- name: TANDEM_ADVERTISE_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{ include "tandem.clusterSecretEnv" .root }}
{{ include "tandem.apiKeyEnv" .root }}
{{ include "tandem.model.env" .root }}
{{ include "tandem.transfer.env" .root }}
{{- if eq $v.device "cuda" }}
- name: TANDEM_KERNEL_CACHE_DIR
  value: {{ include "tandem.engine.kernelCacheDir" . }}
{{- end }}
{{- with (concat $v.engine.extraEnv (index $v .component).extraEnv) }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tandem.engine.kernelCacheDir" -}}/var/cache/tandem-kernels{{- end -}}

{{/* The kernel cache's volume and mount, on CUDA (see values.yaml engine.kernelCache). */}}
{{- define "tandem.engine.kernelCacheVolumes" -}}
{{- $k := .Values.engine.kernelCache -}}
{{- if eq .Values.device "cuda" }}
- name: kernel-cache
{{- if $k.claimName }}
  persistentVolumeClaim:
    claimName: {{ $k.claimName }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $k.sizeLimit }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "tandem.engine.kernelCacheMounts" -}}
{{- if eq .root.Values.device "cuda" }}
- name: kernel-cache
  mountPath: {{ include "tandem.engine.kernelCacheDir" . }}
{{- end }}
{{- end -}}

{{- define "tandem.engine.resources" -}}
{{- $role := index .root.Values .component -}}
{{- $user := deepCopy ($role.resources | default dict) -}}
{{- $gpus := div (int ($role.tpSize | default 1)) (int (include "tandem.engine.nodes" .)) -}}
{{- $extended := fromYaml (include "tandem.transfer.resources" (dict "root" .root "gpus" $gpus)) -}}
{{- $limits := merge (deepCopy ($user.limits | default dict)) $extended -}}
{{- if $limits -}}{{- $_ := set $user "limits" $limits -}}{{- end -}}
{{- toYaml $user -}}
{{- end -}}

{{- define "tandem.engine.podSpec" -}}
{{- $v := .root.Values -}}
{{- $role := index $v .component -}}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $v.transfer.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
terminationGracePeriodSeconds: {{ include "tandem.engine.terminationGrace" .root }}
{{- with $role.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $sidecar := and .root.Values.gateway.enabled (eq .component "decode") (not (include "tandem.engine.isWorker" .)) }}
{{- with (printf "%s\n%s" (include "tandem.model.initContainers" .root) (ternary (include "tandem.gateway.sidecar" .root) "" $sidecar) | trim) }}
initContainers:
  {{- . | nindent 2 }}
{{- end }}
containers:
  - name: {{ .component }}
    image: {{ include "tandem.image" .root }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command: ["tandem"]
    args:
      {{- include "tandem.engine.args" . | nindent 6 }}
    env:
      {{- fromYamlArray (include "tandem.engine.env" .) | toYaml | nindent 6 }}
    {{- if include "tandem.engine.isWorker" . }}
    {{- /* a worker pod runs ranks only: no HTTP, no probes; it exits when the leader stops its ranks */}}
    {{- else }}
    ports:
      - name: http
        containerPort: {{ $v.engine.port }}
      {{- if eq .component "prefill" }}
      - name: bootstrap
        containerPort: {{ $v.bootstrap.port }}
      {{- end }}
      {{- if gt (int (include "tandem.engine.nodes" .)) 1 }}
      - name: dist-init
        containerPort: {{ $v.engine.distInitPort }}
      {{- end }}
    {{- include "tandem.engine.probes" .root | nindent 4 }}
    {{- include "tandem.engine.preStop" .root | nindent 4 }}
    {{- end }}
    {{- with (fromYaml (include "tandem.engine.resources" .)) }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- $sc := deepCopy ($v.securityContext | default dict) }}
    {{- if eq $v.transfer.protocol "rdma" }}
    {{- /* RDMA registers (pins) the KV cache memory */}}
    {{- $caps := deepCopy ($sc.capabilities | default dict) }}
    {{- $_ := set $caps "add" (append ($caps.add | default list) "IPC_LOCK" | uniq) }}
    {{- $_ := set $sc "capabilities" $caps }}
    {{- end }}
    {{- with $sc }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- $mounts := concat (list (dict "name" "dshm" "mountPath" "/dev/shm")) (fromYamlArray (include "tandem.tls.mounts" .root)) }}
    volumeMounts:
      {{- concat $mounts (fromYamlArray (include "tandem.model.mounts" .root)) (fromYamlArray (include "tandem.engine.kernelCacheMounts" .)) (fromYamlArray (include "tandem.lora.mounts" .root)) ($role.extraVolumeMounts | default list) | toYaml | nindent 6 }}
{{- $shm := dict "name" "dshm" "emptyDir" (dict "medium" "Memory" "sizeLimit" $v.shm.sizeLimit) }}
{{- $volumes := concat (list $shm) (fromYamlArray (include "tandem.tls.volumes" .root)) }}
volumes:
  {{- concat $volumes (fromYamlArray (include "tandem.model.volumes" .root)) (fromYamlArray (include "tandem.engine.kernelCacheVolumes" .root)) (fromYamlArray (include "tandem.lora.volumes" .root)) ($role.extraVolumes | default list) | toYaml | nindent 2 }}
{{- with $role.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $role.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $role.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $role.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* startup on /health (the port opens only once the model is loaded), liveness /health, readiness
/health_generate (the scheduler answers); a draining server fails both /health paths. Both need no API
key; with TLS the kubelet asks over HTTPS (it does not verify the certificate). */}}
{{- define "tandem.engine.probes" -}}
{{- $p := .Values.probes -}}
{{- $scheme := include "tandem.scheme" . | upper -}}
startupProbe:
  httpGet:
    path: /health
    port: http
    scheme: {{ $scheme }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
livenessProbe:
  httpGet:
    path: /health
    port: http
    scheme: {{ $scheme }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
readinessProbe:
  httpGet:
    path: /health_generate
    port: http
    scheme: {{ $scheme }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
{{- end -}}

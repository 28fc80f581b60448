{{/* Where the engine servers find the model: the --model value, its volume, mount and download. */}}

{{- define "tandem.model.hfDir" -}}
{{- printf "/models/hf/%s/%s" .Values.model.hf.id .Values.model.hf.revision -}}
{{- end -}}

{{/* The value of `tandem serve --model`. */}}
{{- define "tandem.model.arg" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "builtin" -}}builtin
{{- else if eq $m.source "hf" -}}{{ include "tandem.model.hfDir" . }}
{{- else -}}{{ trimSuffix "/" (printf "/models/%s" (trimPrefix "/" $m.path)) }}
{{- end -}}
{{- end -}}

{{- define "tandem.model.volumes" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: {{ $m.pvc.readOnly }}
{{- else if eq $m.source "hostPath" }}
- name: models
  hostPath:
    path: {{ $m.hostPath.path }}
    type: Directory
{{- else if eq $m.source "hf" }}
- name: models
{{- if $m.hf.cacheClaimName }}
  persistentVolumeClaim:
    claimName: {{ $m.hf.cacheClaimName }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $m.hf.cacheSizeLimit }}
{{- end }}
{{- end }}
{{- if ne $m.source "builtin" }}
# a GGUF model is dequantized once into this cache (TANDEM_CACHE_DIR)
- name: tandem-cache
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "tandem.model.mounts" -}}
{{- $m := .Values.model -}}
{{- if ne $m.source "builtin" }}
- name: models
  mountPath: /models
  readOnly: {{ or (eq $m.source "hostPath") (and (eq $m.source "pvc") $m.pvc.readOnly) (eq $m.source "hf") }}
- name: tandem-cache
  mountPath: /var/cache/tandem
{{- end }}
{{- end -}}

{{- define "tandem.model.env" -}}
{{- if ne .Values.model.source "builtin" }}
- name: TANDEM_CACHE_DIR
  value: /var/cache/tandem
{{- end }}
{{- end -}}

{{/* The initContainer that fetches a Hugging Face model before the server starts (idempotent: files
already in the volume are kept, so a shared cache PVC is downloaded once). */}}
{{- define "tandem.model.initContainers" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "hf" }}
- name: download-model
  image: {{ include "tandem.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["hf", "download"]
  args:
    - {{ $m.hf.id | quote }}
    - --revision
    - {{ $m.hf.revision | quote }}
    - --local-dir
    - {{ include "tandem.model.hfDir" . | quote }}
    {{- range $m.hf.allowPatterns }}
    - --include
    - {{ . | quote }}
    {{- end }}
  env:
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- if $m.hf.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $m.hf.tokenSecret.name }}
          key: {{ $m.hf.tokenSecret.key }}
    {{- end }}
  volumeMounts:
    - name: models
      mountPath: /models
  {{- with $m.hf.downloadResources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end -}}
